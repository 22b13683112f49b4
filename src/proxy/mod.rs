//! The OpenAI-compatible front door: pick a rank, pin the request to it, stream the answer back.
//!
//! Bodies are not buffered where they need not be: vLLM takes the rank in a header, so its request
//! body streams through untouched; only SGLang's body is read and rewritten, because the rank has
//! to go inside it. A request counts as in flight on its rank until the response body ends (the
//! guard rides inside the body), so a long SSE stream keeps counting while it streams.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use tokio::time::Instant;

use crate::config::Config;
use crate::http::error_chain;
use crate::metrics::Metrics;
use crate::policy::{NoRank, Selector};
use crate::table::Table;
use crate::worker::Flavor;

mod body;

pub use body::{BodyTooLarge, BoxError, Done, ProxyBody, UpstreamBody};

/// The pinning header, spelled as vLLM documents it (header names are case-insensitive; SGLang
/// reads the same name).
pub const RANK_HEADER: HeaderName = HeaderName::from_static("x-data-parallel-rank");
/// Names the virtual worker that served a response.
pub const WORKER_HEADER: HeaderName = HeaderName::from_static("x-rankgate-worker");
/// SGLang body fields that pin a rank (older and newer name); a client's own are replaced.
const SGLANG_RANK_FIELDS: [&str; 2] = ["data_parallel_rank", "routed_dp_rank"];

/// Headers that describe one hop, not the message, and so are never forwarded.
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// A proxy error, classified once and mapped to a status and an OpenAI error body in one place.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("unknown path {0}: rankgate serves /v1/chat/completions, /v1/completions, /v1/embeddings and /v1/models")]
    NotFound(String),
    #[error("method {method} not allowed on {path}")]
    MethodNotAllowed { method: Method, path: String },
    #[error("request body exceeds server.max_body_bytes ({0} bytes)")]
    TooLarge(usize),
    #[error("request body is not valid JSON: {0}")]
    BadJson(String),
    #[error("request body must be a JSON object")]
    NotObject,
    #[error("reading the request body: {0}")]
    ClientBody(String),
    #[error("no routable rank: {0}")]
    NoRank(#[from] NoRank),
    #[error("upstream {engine} failed: {reason}")]
    Upstream { engine: String, reason: String },
}

impl ProxyError {
    fn status(&self) -> StatusCode {
        match self {
            ProxyError::NotFound(_) => StatusCode::NOT_FOUND,
            ProxyError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::BadJson(_) | ProxyError::NotObject | ProxyError::ClientBody(_) => {
                StatusCode::BAD_REQUEST
            }
            ProxyError::NoRank(_) => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::Upstream { .. } => StatusCode::BAD_GATEWAY,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ProxyError::NotFound(_) => "NotFoundError",
            ProxyError::MethodNotAllowed { .. } => "MethodNotAllowedError",
            ProxyError::TooLarge(_)
            | ProxyError::BadJson(_)
            | ProxyError::NotObject
            | ProxyError::ClientBody(_) => "BadRequestError",
            ProxyError::NoRank(_) => "ServiceUnavailableError",
            ProxyError::Upstream { .. } => "UpstreamError",
        }
    }
}

/// The front door's shared state.
pub struct Proxy {
    table: Arc<Table>,
    selector: Arc<Selector>,
    metrics: Arc<Metrics>,
    client: Client<HttpConnector, UpstreamBody>,
    max_body: usize,
    retry_after: HeaderValue,
    /// Per worker: the `x-rankgate-worker` value, rendered once.
    worker_headers: Vec<HeaderValue>,
    /// Per engine: its authority, parsed once.
    authorities: Vec<Authority>,
}

impl Proxy {
    pub fn new(cfg: &Config, table: Arc<Table>, metrics: Arc<Metrics>) -> Proxy {
        let worker_headers = table
            .fleet
            .workers
            .iter()
            .map(|w| {
                HeaderValue::from_str(&w.id_text).unwrap_or(HeaderValue::from_static("invalid"))
            })
            .collect();
        let authorities = table
            .fleet
            .engines
            .iter()
            // Validated at config load; a failure here would be a bug in validation.
            .map(|e| {
                Authority::try_from(&*e.authority)
                    .unwrap_or(Authority::from_static("invalid.invalid:1"))
            })
            .collect();
        Proxy {
            selector: Arc::new(Selector::new(&cfg.routing)),
            metrics,
            client: crate::http::client(cfg.server.connect_timeout),
            max_body: cfg.server.max_body_bytes,
            retry_after: HeaderValue::from(cfg.routing.retry_after_secs),
            worker_headers,
            authorities,
            table,
        }
    }

    pub fn selector(&self) -> &Arc<Selector> {
        &self.selector
    }

    /// Serves one client request; every failure becomes an OpenAI-shaped error response.
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, Infallible> {
        let started = Instant::now();
        match self.forward(req, started).await {
            Ok(resp) => Ok(resp),
            Err((err, worker)) => {
                let status = err.status();
                match worker {
                    Some(w) => self.metrics.response(w, status.as_u16()),
                    None => self.metrics.own_response(status.as_u16()),
                }
                if status.is_server_error() {
                    tracing::warn!(error = %err, "request failed");
                } else {
                    tracing::debug!(error = %err, "request refused");
                }
                let mut resp: Response<ProxyBody> =
                    crate::http::openai_error(status, err.kind(), &err.to_string());
                if status == StatusCode::SERVICE_UNAVAILABLE {
                    resp.headers_mut()
                        .insert(header::RETRY_AFTER, self.retry_after.clone());
                }
                if let Some(w) = worker {
                    resp.headers_mut()
                        .insert(WORKER_HEADER, self.worker_headers[w].clone());
                }
                Ok(resp)
            }
        }
    }

    async fn forward(
        &self,
        req: Request<Incoming>,
        started: Instant,
    ) -> Result<Response<ProxyBody>, (ProxyError, Option<usize>)> {
        let path = req.uri().path();
        let needs_body = match path {
            "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings" => {
                if req.method() != Method::POST {
                    return Err((not_allowed(&req), None));
                }
                true
            }
            "/v1/models" => {
                if req.method() != Method::GET {
                    return Err((not_allowed(&req), None));
                }
                false
            }
            other => return Err((ProxyError::NotFound(other.to_string()), None)),
        };
        let length = content_length(req.headers());
        if length.is_some_and(|n| n > self.max_body as u64) {
            return Err((ProxyError::TooLarge(self.max_body), None));
        }

        let picked = self
            .selector
            .pick(&self.table, length)
            .map_err(|e| (e.into(), None))?;
        if picked.skipped_unavailable {
            self.metrics.skipped_unavailable();
        }
        let w = picked.guard.worker();
        let worker = &self.table.fleet.workers[w];
        let engine = &self.table.fleet.engines[worker.engine];
        let fail = |e: ProxyError| (e, Some(w));

        let (mut parts, body) = req.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        // The client's own pin never reaches the engine: rankgate decides the rank.
        parts.headers.remove(&RANK_HEADER);
        parts.headers.remove(header::HOST);
        if let Some(rank) = worker.pin_rank {
            parts.headers.insert(RANK_HEADER, HeaderValue::from(rank));
        }
        parts.version = Version::HTTP_11;
        let pq = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(Scheme::HTTP);
        uri.authority = Some(self.authorities[worker.engine].clone());
        uri.path_and_query = Some(pq);
        parts.uri = Uri::from_parts(uri).map_err(|e| {
            fail(ProxyError::Upstream {
                engine: engine.url.to_string(),
                reason: format!("building URI: {e}"),
            })
        })?;

        let up_body = match (engine.flavor, needs_body, worker.pin_rank) {
            (Flavor::Sglang, true, Some(rank)) => {
                let bytes = Limited::new(body, self.max_body)
                    .collect()
                    .await
                    .map_err(|e| {
                        fail(if e.is::<http_body_util::LengthLimitError>() {
                            ProxyError::TooLarge(self.max_body)
                        } else {
                            ProxyError::ClientBody(e.to_string())
                        })
                    })?
                    .to_bytes();
                let rewritten = pin_in_body(&bytes, rank).map_err(fail)?;
                parts
                    .headers
                    .insert(header::CONTENT_LENGTH, HeaderValue::from(rewritten.len()));
                UpstreamBody::Full(Some(rewritten))
            }
            _ => UpstreamBody::Stream {
                body,
                remaining: self.max_body,
            },
        };

        let resp = self
            .client
            .request(Request::from_parts(parts, up_body))
            .await
            .map_err(|e| {
                let too_large =
                    std::iter::successors(Some(&e as &(dyn std::error::Error + 'static)), |e| {
                        e.source()
                    })
                    .any(|s| s.is::<BodyTooLarge>());
                fail(if too_large {
                    ProxyError::TooLarge(self.max_body)
                } else {
                    ProxyError::Upstream {
                        engine: engine.url.to_string(),
                        reason: error_chain(&e),
                    }
                })
            })?;

        let (mut parts, body) = resp.into_parts();
        self.metrics.response(w, parts.status.as_u16());
        strip_hop_by_hop(&mut parts.headers);
        parts
            .headers
            .insert(WORKER_HEADER, self.worker_headers[w].clone());
        let done = Box::new(Done {
            _guard: picked.guard,
            started,
            metrics: self.metrics.clone(),
        });
        Ok(Response::from_parts(
            parts,
            ProxyBody::Upstream {
                body,
                done: Some(done),
            },
        ))
    }
}

fn not_allowed(req: &Request<Incoming>) -> ProxyError {
    ProxyError::MethodNotAllowed {
        method: req.method().clone(),
        path: req.uri().path().to_string(),
    }
}

fn content_length(h: &HeaderMap) -> Option<u64> {
    h.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

fn strip_hop_by_hop(h: &mut HeaderMap) {
    // Headers the Connection header names are hop-by-hop too.
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named.iter().chain(HOP_BY_HOP.iter()) {
        h.remove(n);
    }
}

/// Writes the rank into an SGLang request body, replacing any rank the client set.
///
/// Only the top level is parsed: each member's value is kept as its raw JSON text and copied
/// through, so a long prompt is validated but never built into a tree and printed again.
pub fn pin_in_body(body: &[u8], rank: u32) -> Result<Bytes, ProxyError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first.is_some() && first != Some(&b'{') {
        // Valid JSON that is not an object says so; invalid JSON gets the parser's message.
        return match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
            Ok(_) => Err(ProxyError::NotObject),
            Err(e) => Err(ProxyError::BadJson(e.to_string())),
        };
    }
    let members: Vec<(String, &serde_json::value::RawValue)> =
        serde_json::from_slice::<RawObject>(body)
            .map_err(|e| ProxyError::BadJson(e.to_string()))?
            .0;
    let mut out = Vec::with_capacity(body.len() + 32);
    out.push(b'{');
    for (key, value) in members
        .iter()
        .filter(|(k, _)| !SGLANG_RANK_FIELDS.contains(&k.as_str()))
    {
        // Re-escaping the key through serde_json keeps it valid whatever it holds.
        serde_json::to_writer(&mut out, key).map_err(|e| ProxyError::BadJson(e.to_string()))?;
        out.push(b':');
        out.extend_from_slice(value.get().as_bytes());
        out.push(b',');
    }
    out.extend_from_slice(format!("\"{}\":{rank}}}", SGLANG_RANK_FIELDS[0]).as_bytes());
    Ok(Bytes::from(out))
}

/// A JSON object's members in order, values as raw JSON borrowed from the input.
struct RawObject<'a>(Vec<(String, &'a serde_json::value::RawValue)>);

impl<'de: 'a, 'a> serde::Deserialize<'de> for RawObject<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Members<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Members<'a> {
            type Value = RawObject<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(
                self,
                mut map: M,
            ) -> Result<Self::Value, M::Error> {
                let mut members = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some(entry) =
                    map.next_entry::<String, &'de serde_json::value::RawValue>()?
                {
                    members.push(entry);
                }
                Ok(RawObject(members))
            }
        }
        d.deserialize_map(Members(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_in_body_keeps_everything_else_verbatim() {
        let body = br#" {"model":"m","messages":[{"role":"user","content":"a \"quoted\" \u00e9 prompt"}],"max_tokens":8,"data_parallel_rank":3,"stream":true,"x":{"nested":[1,2.5e3,null]}} "#;
        let out = pin_in_body(body, 5).unwrap();
        let got: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let mut want: serde_json::Value = serde_json::from_slice(body).unwrap();
        want["data_parallel_rank"] = 5.into();
        assert_eq!(got, want);
        // Raw values are copied, not re-printed: the escapes survive byte for byte.
        assert!(std::str::from_utf8(&out)
            .unwrap()
            .contains(r#""a \"quoted\" \u00e9 prompt""#));
        assert!(matches!(pin_in_body(b"", 0), Err(ProxyError::BadJson(_))));
        assert!(matches!(
            pin_in_body(b"{\"a\":1} trailing", 0),
            Err(ProxyError::BadJson(_))
        ));
        assert!(matches!(
            pin_in_body(b"\"str\"", 0),
            Err(ProxyError::NotObject)
        ));
    }

    use proptest::prelude::*;

    proptest! {
        /// Whatever the object, the result is the same object with only the rank fields changed.
        #[test]
        fn pin_in_body_is_a_minimal_edit(
            members in proptest::collection::btree_map("[a-z_\"\\\\é ]{0,12}", prop_oneof![
                any::<i64>().prop_map(serde_json::Value::from),
                "[ -~é\n]{0,20}".prop_map(serde_json::Value::from),
                any::<bool>().prop_map(serde_json::Value::from),
            ], 0..8),
            rank in 0u32..1000,
        ) {
            let input = serde_json::Value::Object(members.into_iter().collect());
            let out = pin_in_body(input.to_string().as_bytes(), rank).unwrap();
            let got: serde_json::Value = serde_json::from_slice(&out).unwrap();
            let mut want = input.clone();
            let obj = want.as_object_mut().unwrap();
            obj.remove("routed_dp_rank");
            obj.insert("data_parallel_rank".into(), rank.into());
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn pin_in_body_replaces_client_fields() {
        let out = pin_in_body(
            br#"{"model":"m","data_parallel_rank":7,"routed_dp_rank":7}"#,
            2,
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["data_parallel_rank"], 2);
        assert!(v.get("routed_dp_rank").is_none());
        assert_eq!(v["model"], "m");
        assert!(matches!(pin_in_body(b"[1]", 0), Err(ProxyError::NotObject)));
        assert!(matches!(pin_in_body(b"{", 0), Err(ProxyError::BadJson(_))));
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_go() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert("x-keep", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-keep"));
    }
}
