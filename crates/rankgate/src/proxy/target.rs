//! Where a request goes once `pick` has chosen: the worker and its engine ([`Target`]), carried
//! down the stack with the request body ([`Picked`]) and back up in the response body.

use std::sync::Arc;

use crate::table::InFlight;
use crate::upstream::RequestBody;
use crate::worker::{EngineEntry, Member};

/// The worker a request was sent to, and whether it is that rank's ejection trial; set by `pick`
/// on the request for the layers below it ([`Picked`]), and on the response body for those
/// above ([`ProxyBody::target`](super::body::ProxyBody::target)). Carried in the types rather than in `http::Extensions`, whose
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
    pub guard: InFlight,
}

pub use super::leg::PrefillLeg;

/// A request extension: no retry starts after this instant (a decode leg, after its prefill
/// server's blocks would have been released), and whether an engine's 500 is retried like a
/// 502 until then (a decode leg: a decode server whose KV pull failed answers 500 before any
/// byte, and another decode rank may pull the same blocks).
#[derive(Debug, Clone, Copy)]
pub struct RetryUntil(pub tokio::time::Instant, pub bool);

/// A request extension on a leg whose body depends on the rank chosen for it (an SGLang prefill
/// leg: the room must land on that rank): `pick` calls it with its choice, and sends the body
/// it returns.
#[derive(Clone)]
#[allow(clippy::type_complexity)]
pub struct LegHook(
    pub Arc<dyn Fn(&Target) -> Result<bytes::Bytes, super::error::ProxyError> + Send + Sync>,
);

impl std::fmt::Debug for LegHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LegHook")
    }
}
