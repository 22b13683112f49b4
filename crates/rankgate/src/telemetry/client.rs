//! How the telemetry tasks reach an engine over HTTP: the polls' client (the shared pool and
//! the engine's own key) and one bounded GET whose failure says whether anything answered.
//! A leaf, so the poller, detection, health probe and model reader all use it without
//! importing one another.

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};

use crate::http::error_chain;
use crate::worker::ApiKey;

/// Largest telemetry body accepted; a real vLLM /metrics is ~70 KB.
const MAX_TELEMETRY_BYTES: usize = 8 * 1024 * 1024;

/// The HTTP client of one engine's polls: the shared connection pool, and the engine's own key.
#[derive(Clone)]
pub struct HttpClient {
    client: crate::http::HttpClient<Empty<Bytes>>,
    key: Option<ApiKey>,
    /// Each [`fetch`] bounded by this, its failure then naming it (`check --probe`, which
    /// says which request got no answer); `None` where the caller bounds a whole step.
    limit: Option<std::time::Duration>,
}

impl HttpClient {
    pub fn new(client: crate::http::HttpClient<Empty<Bytes>>) -> HttpClient {
        HttpClient {
            client,
            key: None,
            limit: None,
        }
    }

    pub(super) fn with_key(&self, key: Option<ApiKey>) -> HttpClient {
        HttpClient {
            client: self.client.clone(),
            key,
            limit: self.limit,
        }
    }

    /// This client with each [`fetch`] bounded by `limit`.
    pub(super) fn with_limit(&self, limit: std::time::Duration) -> HttpClient {
        HttpClient {
            limit: Some(limit),
            ..self.clone()
        }
    }

    /// GET `uri`, with the engine's bearer key when it has one.
    pub fn get(&self, uri: http::Uri) -> hyper_util::client::legacy::ResponseFuture {
        let mut req = http::Request::new(Empty::new());
        *req.uri_mut() = uri;
        if let Some(key) = &self.key {
            req.headers_mut()
                .insert(http::header::AUTHORIZATION, key.0.clone());
        }
        self.client.request(req)
    }
}

/// Why one read of one source failed.
pub(super) struct Failure {
    /// Something answered (an HTTP status, a gRPC status): the endpoint is up.
    pub(super) answered: bool,
    pub(super) reason: String,
    /// The HTTP status, when the failure is one (a 404 says the engine has no such route).
    pub(super) status: Option<http::StatusCode>,
}

impl Failure {
    pub(super) fn silent(reason: String) -> Failure {
        Failure {
            answered: false,
            reason,
            status: None,
        }
    }
}

/// GET `uri` and read its body (bounded); an HTTP error status is a failure that answered.
pub(super) async fn fetch(client: &HttpClient, uri: http::Uri) -> Result<Bytes, Failure> {
    match client.limit {
        None => fetch_unbounded(client, uri).await,
        Some(limit) => tokio::time::timeout(limit, fetch_unbounded(client, uri))
            .await
            .unwrap_or_else(|_| {
                Err(Failure::silent(format!(
                    "no answer within {} ms",
                    limit.as_millis()
                )))
            }),
    }
}

async fn fetch_unbounded(client: &HttpClient, uri: http::Uri) -> Result<Bytes, Failure> {
    let resp = client
        .get(uri)
        .await
        .map_err(|e| Failure::silent(error_chain(&e)))?;
    let status = resp.status();
    let body = Limited::new(resp.into_body(), MAX_TELEMETRY_BYTES)
        .collect()
        .await
        .map_err(|e| Failure {
            answered: true,
            reason: format!("reading body: {e}"),
            status: None,
        })?
        .to_bytes();
    if !status.is_success() {
        return Err(Failure {
            answered: true,
            reason: format!("HTTP {status}"),
            status: Some(status),
        });
    }
    Ok(body)
}
