//! Reading the admin listener: one bounded GET of `/workers` and one of `/metrics` per poll,
//! with errors short enough for the status line and advice where rustls's words alone do not
//! say what to do.

use std::time::Duration;

use bytes::Bytes;
use http::{header, Request, Uri};
use http_body_util::{BodyExt, Empty, Limited};
use tokio::time::Instant;

/// Largest `/workers` or `/metrics` body read (a large fleet's `/workers` is a few MB).
const MAX_BODY: usize = 32 * 1024 * 1024;

/// Reads the admin listener: one GET of `/workers` and one of `/metrics` per poll.
#[derive(Clone)]
pub(crate) struct Fetcher {
    pub(crate) client: rankgate::http::HttpClient<Empty<Bytes>>,
    pub(crate) workers: Uri,
    pub(crate) metrics: Uri,
    pub(crate) timeout: Duration,
}

/// What one poll read, for [`Top::apply`].
pub(crate) struct Fetched {
    pub(crate) at: Instant,
    pub(crate) workers: Result<Bytes, String>,
    pub(crate) metrics: Result<String, String>,
}

impl Fetcher {
    pub(crate) async fn fetch(&self) -> Fetched {
        // Both at once, so a slow `/metrics` does not age the rows.
        let (workers, metrics) = tokio::join!(
            get(&self.client, &self.workers, self.timeout),
            get(&self.client, &self.metrics, self.timeout)
        );
        Fetched {
            at: Instant::now(),
            workers,
            metrics: metrics.map(|b| String::from_utf8_lossy(&b).into_owned()),
        }
    }
}

/// One GET, the whole body, within `timeout`; the error is short enough for the status line.
async fn get(
    client: &rankgate::http::HttpClient<Empty<Bytes>>,
    uri: &Uri,
    timeout: Duration,
) -> Result<Bytes, String> {
    let path = uri.path();
    let req = Request::get(uri.clone())
        .header(
            header::USER_AGENT,
            concat!("rankgate-top/", env!("CARGO_PKG_VERSION")),
        )
        .body(Empty::new())
        .map_err(|e| format!("GET {path}: {e}"))?;
    let read = async {
        let resp = (client.request(req).await).map_err(|e| explained(&e))?;
        if resp.status() == http::StatusCode::NOT_FOUND {
            // The usual mistake: the front door's address for the admin listener's.
            return Err(format!(
                "GET {path}: HTTP 404 (is this server.admin_listen?)"
            ));
        }
        if !resp.status().is_success() {
            return Err(format!("GET {path}: HTTP {}", resp.status()));
        }
        let body = Limited::new(resp.into_body(), MAX_BODY).collect().await;
        body.map(|b| b.to_bytes())
            .map_err(|e| format!("GET {path}: reading the body: {e}"))
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(r) => r,
        Err(_) => Err(format!(
            "GET {path}: no answer within {} ms",
            timeout.as_millis()
        )),
    }
}

/// The innermost error, with advice where rustls's words alone do not say what to do (a CA
/// served as the server's certificate).
fn explained(e: &(dyn std::error::Error + 'static)) -> String {
    let cause = root_cause(e);
    match rankgate::tls::advice(&cause) {
        Some(advice) => format!("{cause}: {advice}"),
        None => cause,
    }
}

/// The innermost error: hyper-util's outer layers ("client error (Connect)") say little, the
/// last source ("Connection refused") says what happened, in the room a status line has.
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut last = e;
    // Bounded: error chains are short, and this stops at 16 links whatever they are.
    for _ in 0..16 {
        match last.source() {
            Some(s) => last = s,
            None => break,
        }
    }
    last.to_string()
}
