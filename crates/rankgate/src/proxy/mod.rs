//! The OpenAI-compatible front door, as a stack of tower layers, each owning one concern:
//!
//! ```text
//! identity  hop-by-hop headers removed; x-request-id (kept or made) to the engine and back;
//!           X-Forwarded-For/-Proto (a client's kept only from server.trusted_proxies)
//! trace     W3C trace context continued or started; the request's span; x-rankgate-debug
//! cors      server.cors_allow_origins: preflights answered here (before any key is asked
//!           for), CORS headers on every answer to an allowed origin
//! respond   errors -> OpenAI-shaped responses, metrics, latency
//! auth      server.api_keys_*: 401 without a valid `Authorization: Bearer` key (above route:
//!           no key, no route table); x-rankgate-debug only with the admin token
//! route     the route table: what is proxied to which flavor; the fleet's /v1/models; 404 / 405
//! read      the request body: 413, 400 when broken, 408 when stalled; kept whole for replays
//! select    the engines serving the request's model (scanned, not parsed) and route
//! tokens    routing.kv_events: the prompt's token ids, off the runtime's threads
//! admit     server.max_in_flight -> 429 (after the body is in: a slow upload holds no slot)
//! disagg    a model served by prefill and decode servers: the request in two legs, each
//!           through the layers below (its own pick, retries and outlier accounting)
//! retry     failover before the first byte, to another rank, within a retry budget
//! pick      the rank (never one with unknown telemetry while one has numbers, never an ejected
//!           one), pinned; an
//!           `upstream` span per attempt of a traced request
//! observe   outlier accounting: consecutive failures eject a rank
//! send      the engine connection (capped per engine); no first byte past the fleet's bound
//!           -> a hung request, a failure of the rank (hung.rs); server.response_timeout -> 504;
//!           the response streamed back under server.stream_idle_timeout
//! ```
//!
//! The stacks are assembled in `stack.rs`, where each layer is handed its own settings and state
//! ([`Layers`], made once per router); all they share is [`Shared`] (table, selector, metrics)
//! and, per connection, [`Ctx`]. The types the layers pass between them live in leaf files
//! (`error.rs`, `layer.rs`, `target.rs`, `shared.rs`), so no layer imports this module. What a
//! client learns of the fleet (the worker header, error messages) is `exposure.rs`'s alone.
//!
//! A request counts as in flight on its rank until the response body ends: the guards
//! (`guards.rs`) ride in the body ([`Holds`]), so a long SSE stream keeps counting while it
//! streams.

/// The associated types and readiness every layer below `respond` shares: each is always ready
/// (admission is decided per request, as a 429); the argument is the layer's future.
macro_rules! layer_types {
    ($future:ty) => {
        type Response = http::Response<$crate::proxy::body::ProxyBody>;
        type Error = $crate::proxy::error::ProxyError;
        type Future = $future;

        fn poll_ready(
            &mut self,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), $crate::proxy::error::ProxyError>> {
            std::task::Poll::Ready(Ok(()))
        }
    };
}

mod admit;
mod auth;
mod body;
mod budget;
mod cors;
pub(crate) mod dial;
mod disagg;
mod error;
mod exposure;
mod flow;
pub(crate) mod grpc;
mod guards;
mod hung;
mod identity;
mod layer;
mod leg;
mod observe;
mod pick;
mod pin;
mod read;
mod reroute;
mod respond;
mod retry;
pub(crate) mod route;
mod select;
pub(crate) mod send;
mod shared;
mod stack;
mod streams;
mod target;
#[cfg(test)]
mod tests;
mod tokens;
pub(crate) mod trace;

pub use crate::scan::json_member;
pub use crate::upstream::{BodyTooLarge, BoxError, ClientBodyError, RequestBody};
pub use auth::{Keys, KeysError};
pub use body::{Ending, Holds, ProxyBody};
pub use error::{DebugRefused, Denied, GrpcError, ProxyError};
pub use exposure::Exposure;
pub use flow::{collector as flow_collector, page as flow_page, Flows, KeyBinding};
pub use hung::watch_first_bytes;
pub use identity::REQUEST_ID;
pub use layer::{Answer, Below, Step, RANK_HEADER, WORKER_HEADER};
pub use pin::pin_in_body;
pub use send::sweep_idle_connections;
pub use shared::{Conn, Ctx, Front, Shared};
pub use stack::{grpc_stack, stack, Layers};
pub use target::{Picked, Target};
