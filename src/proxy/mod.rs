//! The OpenAI-compatible front door, as a stack of tower layers, each owning one concern:
//!
//! ```text
//! identity  x-request-id (kept or made) to the engine and back; X-Forwarded-For/-Proto
//! trace     W3C trace context continued or started; the request's span; x-rankgate-debug
//! cors      server.cors_allow_origins: preflights answered here (before any key is asked
//!           for), CORS headers on every answer to an allowed origin
//! respond   errors -> OpenAI-shaped responses, metrics, latency
//! auth      server.api_keys_*: 401 without a valid `Authorization: Bearer` key (above route:
//!           no key, no route table); x-rankgate-debug only with the admin token
//! route     the route table: what is proxied to which flavor; the fleet's /v1/models; 404 / 405
//! read      the request body: 413, 400 when broken, 408 when stalled; kept whole for replays
//! select    the engines serving the request's model (scanned, not parsed) and route
//! admit     server.max_in_flight -> 429 (after the body is in: a slow upload holds no slot)
//! retry     failover before the first byte, to another rank, within a retry budget
//! pick      the rank (never one with unknown telemetry, never an ejected one), pinned; an
//!           `upstream` span per attempt of a traced request
//! observe   outlier accounting: consecutive failures eject a rank
//! send      the engine connection (capped per engine); server.response_timeout -> 504; the
//!           response streamed back under server.stream_idle_timeout
//! ```
//!
//! A request counts as in flight on its rank until the response body ends: the guards ride in the
//! body ([`body::Holds`]), so a long SSE stream keeps counting while it streams.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{header, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use tower::ServiceBuilder;

use crate::catalog::ModelError;
use crate::config::Config;
use crate::http::Throttle;
use crate::metrics::Metrics;
use crate::policy::{NoRank, Selector};
use crate::table::Table;
use crate::tls::Upstream;
use crate::worker::{EngineEntry, Member};

/// What every layer below `respond` answers.
type Answer = Result<Response<ProxyBody>, ProxyError>;

/// The associated types and readiness every layer below `respond` shares: each is always ready
/// (admission is decided per request, as a 429); the argument is the layer's future.
macro_rules! layer_types {
    ($future:ty) => {
        type Response = http::Response<$crate::proxy::ProxyBody>;
        type Error = $crate::proxy::ProxyError;
        type Future = $future;

        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), $crate::proxy::ProxyError>> {
            std::task::Poll::Ready(Ok(()))
        }
    };
}

mod admit;
mod auth;
mod body;
mod budget;
mod cors;
pub(crate) mod grpc;
mod identity;
mod observe;
mod pick;
mod pin;
mod read;
mod respond;
mod retry;
pub(crate) mod route;
mod select;
pub(crate) mod send;
#[cfg(test)]
mod tests;
pub(crate) mod trace;

pub use crate::scan::json_member;
pub use crate::upstream::{BodyTooLarge, BoxError, ClientBodyError, RequestBody};
pub use auth::{Denied, Keys, KeysError};
pub use body::{Ending, Holds, ProxyBody};
pub use grpc::{Front, GrpcError};
pub use identity::REQUEST_ID;
pub use pin::pin_in_body;
pub use send::sweep_idle_connections;

/// The pinning header, spelled as vLLM documents it (header names are case-insensitive; SGLang
/// reads the same name).
pub const RANK_HEADER: HeaderName = HeaderName::from_static("x-data-parallel-rank");
/// Names the virtual worker that served a response.
pub const WORKER_HEADER: HeaderName = HeaderName::from_static("x-rankgate-worker");

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

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
    Scan(#[from] crate::scan::ScanError),
    #[error("method {method} not allowed on {path} (it takes {allow})")]
    MethodNotAllowed {
        method: Method,
        path: String,
        allow: Method,
    },
    #[error("{0}")]
    Unauthorized(Denied),
    #[error("{0}")]
    Debug(trace::DebugRefused),
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
            _ => 0,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self.root() {
            ProxyError::NotFound(_)
            | ProxyError::NoEngineFor(_)
            | ProxyError::Model(ModelError::NotFound { .. }) => StatusCode::NOT_FOUND,
            ProxyError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ProxyError::Debug(d) => match d {
                trace::DebugRefused::NotOne => StatusCode::BAD_REQUEST,
                trace::DebugRefused::Off => StatusCode::FORBIDDEN,
                trace::DebugRefused::Missing | trace::DebugRefused::Wrong => {
                    StatusCode::UNAUTHORIZED
                }
            },
            ProxyError::OriginNotAllowed(_) => StatusCode::FORBIDDEN,
            ProxyError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::BadJson(_)
            | ProxyError::NotObject
            | ProxyError::Refused(_)
            | ProxyError::Scan(_)
            | ProxyError::Model(ModelError::Missing(_))
            | ProxyError::ClientBody(ClientBodyError::Broken(_)) => StatusCode::BAD_REQUEST,
            ProxyError::ClientBody(ClientBodyError::Stalled(_)) => StatusCode::REQUEST_TIMEOUT,
            ProxyError::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::NoRank(_)
            | ProxyError::NoRankUnlisted { .. }
            | ProxyError::EngineBusy { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::Upstream { .. } | ProxyError::StaleConnection { .. } => {
                StatusCode::BAD_GATEWAY
            }
            ProxyError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Internal(_) | ProxyError::At { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            ProxyError::Grpc(g) => g.http.unwrap_or(grpc::http_status(g.code)),
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
            ProxyError::Model(ModelError::NotFound { .. }) => {
                (Some("model"), "model_not_found".into())
            }
            ProxyError::Model(ModelError::Missing(_)) | ProxyError::Scan(_) => {
                (Some("model"), self.status().as_u16().into())
            }
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
}

/// What every layer may read, made once for the router: the table, the selector, the metrics
/// and the config, and the state that must be one for all connections (the retry budget, the
/// admission count, the engine connection pool and its slots).
pub struct Shared {
    pub table: Arc<Table>,
    pub selector: Arc<Selector>,
    pub metrics: Arc<Metrics>,
    pub cfg: Config,
    /// In-flight gRPC request ids and their engines (for Abort).
    grpc_requests: Arc<grpc::Requests>,
    /// h2 clients for engines' gRPC services: client `k` holds an engine's `k`th connection,
    /// opened once the connections before it carry their share of calls (send).
    grpc_clients: Vec<crate::http::HttpClient<RequestBody>>,
    /// Shutdown has begun (the gRPC health service then says NOT_SERVING).
    pub draining: Arc<std::sync::atomic::AtomicBool>,
    /// Retries' allowance (retry).
    budget: budget::RetryBudget,
    /// Requests admitted now (admit).
    admitted: AtomicUsize,
    /// What new HTTP/1 connections to engines are opened with (send); each engine's slots
    /// and idle connections are in its fleet entry.
    connector: crate::http::Connector,
    /// How `https://` engines are reached.
    pub upstream: Upstream,
    /// One log line per few seconds for server-side errors, however many requests hit them
    /// (respond).
    storm: Throttle,
    retry_after: HeaderValue,
    /// The accepted client keys; `None`: no key is asked for (auth).
    keys: Option<Keys>,
    /// The admin token, which `x-rankgate-debug` needs (auth); `None`: debugging is off.
    debug_token: Option<Keys>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Shared")
    }
}

impl Shared {
    /// `keys` as [`Keys::load`] read them at startup; `upstream` as `[engine_tls]` says.
    pub fn new(
        cfg: &Config,
        table: Arc<Table>,
        metrics: Arc<Metrics>,
        keys: Option<Keys>,
        upstream: &Upstream,
    ) -> Arc<Shared> {
        let server = &cfg.server;
        Arc::new(Shared {
            grpc_requests: Arc::default(),
            grpc_clients: (0..server
                .max_engine_connections
                .min(crate::upstream::MAX_GRPC_CONNECTIONS))
                .map(|_| crate::http::h2_client_with(server.connect_timeout, upstream))
                .collect(),
            draining: Arc::default(),
            selector: Arc::new(Selector::new(&cfg.routing)),
            metrics,
            cfg: cfg.clone(),
            budget: budget::RetryBudget::new(cfg.routing.retry_budget),
            admitted: AtomicUsize::new(0),
            connector: crate::http::connector(server.connect_timeout, upstream, false),
            upstream: upstream.clone(),
            storm: Throttle::new(Duration::from_secs(5)),
            retry_after: HeaderValue::from(cfg.routing.retry_after_secs),
            keys,
            debug_token: (server.admin_token.as_ref()).map(|t| Keys::single(&t.0)),
            table,
        })
    }
}

/// A connection's own handle on [`Shared`], what every layer and guard holds, with what is
/// known of the connection itself.
///
/// hyper's adapter clones the whole stack for every request, `read` and `retry` clone what is
/// below them, and each guard in a response body holds a reference: on one `Arc` shared by all
/// connections, every one of those reference counts is a cache line bouncing between cores on
/// every request. Each connection gets its own handle (one allocation per connection), so these
/// counts stay on the core that runs the connection.
#[derive(Clone)]
pub struct Ctx(Arc<Conn>);

pub struct Conn {
    shared: Arc<Shared>,
    /// The core it is served on (thread-per-core; else 0): whose idle engine connections its
    /// requests take (send).
    pub core: usize,
    /// The client's address.
    pub peer: SocketAddr,
    /// Its IP as a header value (X-Forwarded-For), rendered once for all of its requests.
    pub peer_ip: HeaderValue,
    /// The front door it came in through.
    pub front: Front,
}

impl Ctx {
    pub fn new(shared: &Arc<Shared>, peer: SocketAddr, front: Front) -> Ctx {
        Ctx::on(shared, 0, peer, front)
    }

    /// A connection served on `core`.
    pub fn on(shared: &Arc<Shared>, core: usize, peer: SocketAddr, front: Front) -> Ctx {
        Ctx(Arc::new(Conn {
            shared: shared.clone(),
            core,
            peer,
            peer_ip: identity::peer_ip_header(peer),
            front,
        }))
    }

    fn grpc(&self) -> bool {
        self.0.front == Front::Grpc
    }

    pub fn conn(&self) -> &Conn {
        &self.0
    }
}

impl std::ops::Deref for Ctx {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0.shared
    }
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ctx")
    }
}

/// The worker a request was sent to, and whether it is that rank's ejection trial; set by `pick`
/// on the request for the layers below it ([`Picked`]), and on the response body for those
/// above ([`ProxyBody::target`]). Carried in the types rather than in `http::Extensions`, whose
/// first insert allocates a map: this is every request's path.
#[derive(Debug, Clone)]
pub struct Target {
    pub worker: Arc<Member>,
    pub engine: Arc<EngineEntry>,
    pub trial: bool,
}

/// A request body with the rank it was picked for, and the request's in-flight mark on that
/// rank (moved into the response body by `send`): what the layers below `pick` take.
#[derive(Debug)]
pub struct Picked {
    pub target: Target,
    pub body: RequestBody,
    pub guard: crate::table::InFlight,
}

/// The front door for one connection: the whole stack over `send`, answering every request
/// (errors included), on the engine connections of `core` (thread-per-core; else 0). Made per
/// connection (see [`Ctx`]).
pub fn stack(
    shared: &Arc<Shared>,
    core: usize,
    peer: SocketAddr,
) -> impl tower::Service<
    Request<Incoming>,
    Response = Response<ProxyBody>,
    Error = Infallible,
    Future = impl Future + Send + 'static,
> + Clone
       + Send
       + Unpin
       + 'static {
    let ctx = Ctx::on(shared, core, peer, Front::Http);
    let c = &ctx;
    ServiceBuilder::new()
        .layer_fn(|inner| identity::Identity::new(inner, c))
        .layer_fn(|inner| trace::Trace::new(inner, c))
        .layer_fn(|inner| cors::Cors::new(inner, c))
        .layer_fn(|inner| respond::Respond::new(inner, c))
        .layer_fn(|inner| auth::Auth::new(inner, c))
        .layer_fn(|inner| route::Route::new(inner, c))
        .layer_fn(|inner| read::Read::new(inner, c))
        .layer_fn(|inner| select::Select::new(inner, c))
        .layer_fn(|inner| admit::Admit::new(inner, c))
        .layer_fn(|inner| retry::Retry::new(inner, c))
        .layer_fn(|inner| pick::Pick::new(inner, c))
        .layer_fn(|inner| observe::Observe::new(inner, c))
        .service(send::Send::new(c))
}

/// The gRPC front door for one connection (see [`grpc`]): the HTTP stack's lower half under
/// the gRPC method table, answering every call (errors as gRPC statuses).
pub fn grpc_stack(
    shared: &Arc<Shared>,
    peer: SocketAddr,
) -> impl tower::Service<
    Request<Incoming>,
    Response = Response<ProxyBody>,
    Error = Infallible,
    Future = impl Future + Send + 'static,
> + Clone
       + Send
       + Unpin
       + 'static {
    let ctx = Ctx::new(shared, peer, Front::Grpc);
    let c = &ctx;
    ServiceBuilder::new()
        .layer_fn(|inner| identity::Identity::new(inner, c))
        .layer_fn(|inner| trace::Trace::new(inner, c))
        .layer_fn(|inner| respond::Respond::new(inner, c))
        .layer_fn(|inner| auth::Auth::new(inner, c))
        .layer_fn(|inner| grpc::Route::new(inner, c))
        .layer_fn(|inner| read::Read::new(inner, c))
        .layer_fn(|inner| admit::Admit::new(inner, c))
        .layer_fn(|inner| retry::Retry::new(inner, c))
        .layer_fn(|inner| pick::Pick::new(inner, c))
        .layer_fn(|inner| grpc::Track::new(inner, c))
        .layer_fn(|inner| observe::Observe::new(inner, c))
        .service(send::Send::new(c))
}

fn content_length(h: &HeaderMap) -> Option<u64> {
    h.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// The rest of the stack below a layer, for requests with body `B`.
pub trait Below<B>:
    tower::Service<
    Request<B>,
    Response = Response<ProxyBody>,
    Error = ProxyError,
    Future: Future<Output = Answer> + Send + Unpin + 'static,
>
{
}

impl<B, S> Below<B> for S where
    S: tower::Service<
        Request<B>,
        Response = Response<ProxyBody>,
        Error = ProxyError,
        Future: Future<Output = Answer> + Send + Unpin + 'static,
    >
{
}

/// A layer's answer: the layer below's future as it is (the usual path, no allocation), or a
/// boxed one of the layer's own (an error, or work the layer does after the call).
pub enum Step<F> {
    Below(F),
    Own(BoxFuture<Answer>),
}

impl<F> Step<F> {
    /// An answer that is already known.
    fn ready(answer: Answer) -> Step<F> {
        Step::Own(ready(answer))
    }
}

impl<F: Future<Output = Answer> + Unpin> Future for Step<F> {
    type Output = Answer;

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Answer> {
        match self.get_mut() {
            Step::Below(f) => Pin::new(f).poll(cx),
            Step::Own(f) => f.as_mut().poll(cx),
        }
    }
}

/// A future that is already done, boxed like the layers' own futures.
fn ready<T: Send + 'static>(v: T) -> BoxFuture<T> {
    Box::pin(std::future::ready(v))
}
