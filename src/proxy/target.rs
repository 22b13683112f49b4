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
