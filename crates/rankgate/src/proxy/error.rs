//! What can go wrong with a request, classified once: [`ProxyError`], with the HTTP status,
//! OpenAI error type and gRPC status each kind becomes, and the refusals of the layers that
//! refuse (auth, debugging, gRPC) as data.

use std::sync::Arc;
use std::time::Duration;

use http::{Method, StatusCode};
use tonic::Code;

use super::leg::PrefillLeg;
use crate::catalog::ModelError;
use crate::policy::NoRank;
use crate::scan::ScanError;
use crate::upstream::ClientBodyError;
use crate::worker::Member;

/// A proxy error, classified once and mapped to a status and an OpenAI error body in one place.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("unknown path {0}: rankgate proxies the inference endpoints of vLLM and SGLang (see the route table in the README) and server.extra_routes")]
    NotFound(String),
    #[error("{0} is served by no engine flavor in this fleet")]
    NoEngineFor(String),
    #[error("{0}")]
    Refused(&'static str),
    #[error(transparent)]
    Model(#[from] crate::catalog::ModelError),
    #[error("reading the request's model: {0}")]
    Scan(#[from] ScanError),
    #[error("method {method} not allowed on {path} (it takes {allow})")]
    MethodNotAllowed {
        method: Method,
        path: String,
        allow: Method,
    },
    #[error("{0}")]
    Unauthorized(Denied),
    #[error("{0}")]
    Debug(DebugRefused),
    /// A CORS preflight from an origin `server.cors_allow_origins` does not list.
    #[error("origin {0:?} is not allowed (server.cors_allow_origins)")]
    OriginNotAllowed(String),
    #[error("request body exceeds server.max_body_bytes ({0} bytes)")]
    TooLarge(usize),
    #[error("request body is not valid JSON: {0}")]
    BadJson(String),
    #[error("request body must be a JSON object")]
    NotObject,
    #[error(transparent)]
    ClientBody(#[from] ClientBodyError),
    #[error("rankgate has server.max_in_flight = {0} requests in flight; retry later")]
    Overloaded(usize),
    #[error("this client address has server.max_streams_per_client = {0} requests in flight; retry later")]
    ClientStreams(u32),
    /// Flow control answered it: its wait ran out, the queue was full, or rankgate stopped.
    #[error("{0}")]
    Flow(Box<super::flow::refusal::Refused>),
    #[error("no routable rank: {0}")]
    NoRank(#[from] NoRank),
    /// The request's model is on no known model list; the engines that might serve it (their
    /// lists are not known yet) had no routable rank.
    #[error("no routable rank for model `{model}`: no engine known to serve it, and the engines whose model list is not known yet (just joined, or not answering /v1/models) have none: {why}")]
    NoRankUnlisted { model: Arc<str>, why: NoRank },
    /// Connecting failed, or the connection broke before the response headers.
    #[error("upstream {engine} failed: {reason}")]
    Upstream { engine: Arc<str>, reason: String },
    /// A kept-alive connection to the engine turned out closed when the request went out on
    /// it (an engine that closes idle connections without saying so): the engine never had
    /// the request, and nothing is wrong with it. Tried again, on the same engine too.
    #[error("upstream {engine} had closed the kept connection the request went out on: {reason}")]
    StaleConnection { engine: Arc<str>, reason: String },
    #[error("no response headers within {} ms (server.response_timeout)", .0.as_millis())]
    Timeout(Duration),
    /// Every connection slot to the engine stayed taken for the whole response timeout: the
    /// engine was never asked, so this is no verdict on it.
    #[error("all server.max_engine_connections ({limit}) connections to the engine stayed busy for {} ms", .waited.as_millis())]
    EngineBusy { limit: usize, waited: Duration },
    #[error("internal error: {0}")]
    Internal(String),
    /// A disaggregated request's prefill server answered 200 without the KV transfer
    /// parameters its decode needs: decoding there anyway would silently prefill twice.
    #[error("the prefill server answered without kv_transfer_params: is it started with a KV connector as a KV producer (vLLM: --kv-transfer-config with kv_role kv_producer)? No decode was started")]
    PrefillNoParams,
    /// The prefill server's answer could not be read for its KV transfer parameters.
    #[error("the prefill server's answer could not be read: {0}")]
    PrefillAnswer(String),
    /// The prefill server's KV transfer parameters were refused before any decode saw them
    /// (`disagg/kv_params.rs`): a host that is not the prefill server's, a port out of range, a
    /// member of the wrong type or beyond its size. `why` is for clients (no value in it),
    /// `detail` for the operator's log.
    #[error("the prefill server's kv_transfer_params were refused ({why}): {detail}. No decode was started")]
    PrefillBadParams { why: &'static str, detail: String },
    /// A disaggregated request's decode leg failed after its prefill leg was done: said as the
    /// decode's failure (its status), never as another one (a second prefill's, or "no rank").
    #[error("{0}")]
    Decode(Box<DecodeFailure>),
    /// A model served disaggregated that cannot be split as the fleet stands.
    #[error("{0}")]
    NotDisaggregable(String),
    /// A declared LoRA adapter (`[[adapters]]`) could not be loaded.
    #[error(transparent)]
    Adapter(#[from] crate::adapter_loads::LoadError),
    /// What only the gRPC front door refuses, with the status it becomes.
    #[error(transparent)]
    Grpc(#[from] GrpcError),
    /// Any of the above, on the worker it happened on.
    #[error("{error}")]
    At {
        worker: Arc<Member>,
        error: Box<ProxyError>,
        /// Attempts on engines the request made, this one included (set by retry; 0 before).
        attempts: u32,
    },
}

/// How a disaggregated request's decode leg failed, and what its prefill leg was (for the
/// access log: the request's line names both legs whatever the answer).
#[derive(Debug)]
pub struct DecodeFailure {
    pub why: DecodeWhy,
    pub prefill: PrefillLeg,
}

/// What the decode rank did.
#[derive(Debug)]
pub enum DecodeWhy {
    /// It answered this error status before any byte of an answer, with (the start of) this
    /// reply.
    Answered { status: StatusCode, reply: String },
    /// It failed with this (the transport, the response timeout).
    Failed(ProxyError),
}

impl std::fmt::Display for DecodeFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.why {
            DecodeWhy::Answered { status, reply } if reply.is_empty() => {
                write!(f, "decode rank failed: {status}")
            }
            DecodeWhy::Answered { status, reply } => {
                write!(f, "decode rank failed: {status}: {reply}")
            }
            DecodeWhy::Failed(e) => write!(f, "decode leg failed: {e}"),
        }
    }
}

impl ProxyError {
    /// The error itself, without the worker it happened on.
    pub fn root(&self) -> &ProxyError {
        match self {
            ProxyError::At { error, .. } => error.root(),
            e => e,
        }
    }

    pub fn worker(&self) -> Option<&Arc<Member>> {
        match self {
            ProxyError::At { worker, .. } => Some(worker),
            _ => None,
        }
    }

    /// Marks the error as happened on `worker`.
    pub fn at(self, worker: &Arc<Member>) -> ProxyError {
        match self {
            e @ ProxyError::At { .. } => e,
            e => ProxyError::At {
                worker: worker.clone(),
                error: Box::new(e),
                attempts: 0,
            },
        }
    }

    /// Attempts on engines the request made before failing with this (0: it reached none).
    pub fn attempts(&self) -> u32 {
        match self {
            ProxyError::At { attempts, .. } => (*attempts).max(1),
            ProxyError::Decode(d) => d.prefill.prefill_attempts + d.prefill.decode_attempts,
            _ => 0,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self.root() {
            ProxyError::NotFound(_)
            | ProxyError::NoEngineFor(_)
            | ProxyError::Model(ModelError::NotFound { .. } | ModelError::RouteTarget { .. }) => {
                StatusCode::NOT_FOUND
            }
            ProxyError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ProxyError::Debug(d) => match d {
                DebugRefused::NotOne => StatusCode::BAD_REQUEST,
                DebugRefused::Off => StatusCode::FORBIDDEN,
                DebugRefused::Missing | DebugRefused::Wrong => StatusCode::UNAUTHORIZED,
            },
            ProxyError::OriginNotAllowed(_) => StatusCode::FORBIDDEN,
            ProxyError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::BadJson(_)
            | ProxyError::NotObject
            | ProxyError::Refused(_)
            | ProxyError::Scan(_)
            | ProxyError::Model(ModelError::Missing(_))
            | ProxyError::ClientBody(ClientBodyError::Broken(_)) => StatusCode::BAD_REQUEST,
            ProxyError::ClientBody(ClientBodyError::Stalled(_) | ClientBodyError::TooSlow(_)) => {
                StatusCode::REQUEST_TIMEOUT
            }
            ProxyError::Overloaded(_) | ProxyError::ClientStreams(_) => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ProxyError::NoRank(_)
            | ProxyError::NoRankUnlisted { .. }
            | ProxyError::NotDisaggregable(_)
            | ProxyError::Flow(_)
            | ProxyError::EngineBusy { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::Upstream { .. }
            | ProxyError::StaleConnection { .. }
            | ProxyError::PrefillNoParams
            | ProxyError::PrefillAnswer(_)
            | ProxyError::PrefillBadParams { .. } => StatusCode::BAD_GATEWAY,
            ProxyError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Decode(d) => match &d.why {
                DecodeWhy::Answered { status, .. } => *status,
                DecodeWhy::Failed(e) => e.status(),
            },
            ProxyError::Adapter(a) => a.status(),
            ProxyError::Internal(_) | ProxyError::At { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            ProxyError::Grpc(g) => g.http.unwrap_or(http_status(g.code)),
        }
    }

    /// The OpenAI error `type`.
    pub fn kind(&self) -> &'static str {
        match self.status().as_u16() {
            400 | 413 => "BadRequestError",
            401 => "AuthenticationError",
            403 => "PermissionDeniedError",
            404 => "NotFoundError",
            405 => "MethodNotAllowedError",
            408 => "RequestTimeoutError",
            429 => "RateLimitError",
            503 => "ServiceUnavailableError",
            504 => "GatewayTimeoutError",
            500 => "InternalServerError",
            _ => "UpstreamError",
        }
    }

    /// The OpenAI error `param` and `code`: the model's errors say so, the rest give the status.
    pub fn param_and_code(&self) -> (Option<&'static str>, serde_json::Value) {
        match self.root() {
            ProxyError::Model(ModelError::NotFound { .. } | ModelError::RouteTarget { .. }) => {
                (Some("model"), "model_not_found".into())
            }
            ProxyError::Model(ModelError::Missing(_)) | ProxyError::Scan(_) => {
                (Some("model"), self.status().as_u16().into())
            }
            ProxyError::Flow(f) => (None, f.why.as_str().into()),
            ProxyError::Adapter(_) => (Some("model"), "adapter_not_loaded".into()),
            _ => (None, self.status().as_u16().into()),
        }
    }

    /// Whether another rank may be tried: only failures before anything reached the engine's
    /// application or the client (the transport), never the client's own errors.
    pub fn retryable(&self) -> bool {
        matches!(
            self.root(),
            ProxyError::Upstream { .. } | ProxyError::StaleConnection { .. }
        )
    }

    /// The gRPC status the error becomes.
    pub fn grpc_code(&self) -> Code {
        match self.root() {
            ProxyError::Grpc(g) => g.code,
            ProxyError::NotFound(_)
            | ProxyError::NoEngineFor(_)
            | ProxyError::MethodNotAllowed { .. } => Code::Unimplemented,
            ProxyError::Model(ModelError::NotFound { .. } | ModelError::RouteTarget { .. }) => {
                Code::NotFound
            }
            ProxyError::Unauthorized(_) => Code::Unauthenticated,
            ProxyError::Debug(d) => match d {
                DebugRefused::NotOne => Code::InvalidArgument,
                DebugRefused::Off => Code::PermissionDenied,
                DebugRefused::Missing | DebugRefused::Wrong => Code::Unauthenticated,
            },
            ProxyError::OriginNotAllowed(_) => Code::PermissionDenied,
            ProxyError::TooLarge(_) | ProxyError::Overloaded(_) | ProxyError::ClientStreams(_) => {
                Code::ResourceExhausted
            }
            ProxyError::ClientBody(ClientBodyError::Stalled(_) | ClientBodyError::TooSlow(_))
            | ProxyError::Timeout(_) => Code::DeadlineExceeded,
            ProxyError::BadJson(_)
            | ProxyError::NotObject
            | ProxyError::Refused(_)
            | ProxyError::Scan(_)
            | ProxyError::Model(ModelError::Missing(_))
            | ProxyError::ClientBody(_) => Code::InvalidArgument,
            ProxyError::NoRank(_)
            | ProxyError::NoRankUnlisted { .. }
            | ProxyError::Flow(_)
            | ProxyError::EngineBusy { .. }
            | ProxyError::NotDisaggregable(_)
            | ProxyError::Adapter(_)
            | ProxyError::PrefillNoParams
            | ProxyError::PrefillAnswer(_)
            | ProxyError::PrefillBadParams { .. }
            | ProxyError::Decode(_)
            | ProxyError::Upstream { .. }
            | ProxyError::StaleConnection { .. } => Code::Unavailable,
            ProxyError::Internal(_) | ProxyError::At { .. } => Code::Internal,
        }
    }
}

impl From<DebugRefused> for ProxyError {
    fn from(d: DebugRefused) -> ProxyError {
        ProxyError::Debug(d)
    }
}

/// Why an engine's answer ended early, after its first byte (`body`).
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("engine stream broke: {0}")]
    Broken(String),
    #[error("engine sent nothing for {} ms (server.stream_idle_timeout)", .0.as_millis())]
    Idle(Duration),
    /// The drain grace ran out, or a second signal came, with the stream still going.
    #[error("rankgate is shutting down: the stream was cut before its end")]
    ShuttingDown,
}

/// Why a request was refused: what the client is told (never what was sent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    #[error("missing API key: send the header `Authorization: Bearer <key>`")]
    Missing,
    #[error("the Authorization header must read `Bearer <key>`")]
    NotBearer,
    #[error("invalid API key")]
    Wrong,
}

/// Why `x-rankgate-debug` was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DebugRefused {
    #[error("x-rankgate-debug takes the value 1")]
    NotOne,
    #[error("x-rankgate-debug is off: set server.admin_token_env to the environment variable holding the admin token")]
    Off,
    #[error(
        "x-rankgate-debug needs the admin token: send it as `x-rankgate-admin-token: <token>`"
    )]
    Missing,
    #[error("x-rankgate-debug: invalid admin token")]
    Wrong,
}

/// A gRPC-specific failure, with the status code it becomes.
#[derive(Debug)]
pub struct GrpcError {
    pub code: Code,
    /// What went wrong, in words any client may read: no address, no setting.
    pub message: String,
    /// The HTTP status of the answer when it is not 200: a request that is no gRPC call gets a
    /// status any HTTP client reads as an error.
    pub http: Option<StatusCode>,
    /// The engine it happened on, and the setting that decided, when there is one: for the
    /// logs, and for clients only under `server.expose_worker = "url"` (see `exposure`).
    pub engine: Option<Arc<str>>,
    pub setting: Option<&'static str>,
}

impl std::fmt::Display for GrpcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(engine) = &self.engine {
            write!(f, "{engine}: ")?;
        }
        f.write_str(&self.message)?;
        match self.setting {
            Some(key) => write!(f, " ({key})"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for GrpcError {}

impl GrpcError {
    pub fn new(code: Code, message: impl Into<String>) -> GrpcError {
        GrpcError {
            code,
            message: message.into(),
            http: None,
            engine: None,
            setting: None,
        }
    }

    /// The same, said of `engine`.
    pub fn on(mut self, engine: &Arc<str>) -> GrpcError {
        self.engine = Some(engine.clone());
        self
    }

    /// Not a gRPC call at all: answered with HTTP `http` (and the gRPC status too).
    pub(crate) fn not_grpc(http: StatusCode, message: &str) -> GrpcError {
        GrpcError {
            http: Some(http),
            ..GrpcError::new(Code::InvalidArgument, message)
        }
    }
}

/// The HTTP status a gRPC error would have on the HTTP front door (it never reaches it; this
/// keeps [`ProxyError::status`] total).
pub fn http_status(code: Code) -> StatusCode {
    match code {
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
            StatusCode::BAD_REQUEST
        }
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        _ => StatusCode::BAD_GATEWAY,
    }
}
