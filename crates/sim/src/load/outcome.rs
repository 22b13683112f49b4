//! One request's result as the load client records it, why one failed, and what the client
//! sends and says about the rank that served it (rankgate hides it unless asked with the admin
//! token).

use std::time::Duration;

/// With the admin token, asks rankgate which rank served a request (it answers in
/// `x-rankgate-worker` whatever `server.expose_worker` says).
pub const DEBUG_HEADER: &str = "x-rankgate-debug";
/// Where the admin token goes with [`DEBUG_HEADER`] (`Authorization` carries the API key).
pub const ADMIN_TOKEN_HEADER: &str = "x-rankgate-admin-token";
/// What a report says of a request whose answer named no rank: under the default
/// `server.expose_worker = "none"` rankgate hides it unless asked with the admin token.
pub const HIDDEN: &str = "(hidden by the router: give --admin-token)";
/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    Connect,
    Http4xx,
    Http5xx,
    /// The body failed to arrive whole (a non-streaming answer broken or unreadable).
    Body,
    /// A 2xx stream that ended (cleanly or broken) before the engine's end: no `data: [DONE]`
    /// for SSE, no completion message for gRPC.
    StreamCut,
    /// A 2xx stream that carried an error event (rankgate's `data: {"error": ...}` when it cuts a
    /// stream after its first byte): the answer is incomplete whatever followed.
    StreamErrorEvent,
    Deadline,
}

/// One request's result.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// When it was sent, from the start of the run.
    pub sent: Duration,
    /// How late it was sent against its schedule (the client's own overhead).
    pub lag: Duration,
    pub status: u16,
    pub error: Option<ErrorKind>,
    pub ttft: Option<Duration>,
    /// Gaps between consecutive tokens.
    pub itl: Vec<Duration>,
    pub e2e: Duration,
    pub tokens: u64,
    pub worker: Option<String>,
    /// Output tokens the request asked for (`max_tokens`): its share of its tenant's demand.
    pub asked: u64,
    /// The tenant that sent it, when the run had several (see `load::tenants`).
    pub tenant: Option<std::sync::Arc<str>>,
}

impl Outcome {
    /// A request that got no usable answer.
    pub(crate) fn failed(kind: ErrorKind, e2e: Duration) -> Outcome {
        Outcome {
            sent: Duration::ZERO,
            lag: Duration::ZERO,
            status: 0,
            error: Some(kind),
            ttft: None,
            itl: Vec::new(),
            e2e,
            tokens: 0,
            worker: None,
            asked: 0,
            tenant: None,
        }
    }
}
