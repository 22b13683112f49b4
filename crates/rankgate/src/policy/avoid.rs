//! What a request may not go to: its front door's engines only, those serving its model and
//! route, and on a retry not the ranks (or engines) that failed it; and `eligible`, the one
//! per-rank test every policy applies.

use std::sync::Arc;

use crate::outlier::Admit;
use crate::worker::{Engine, EngineEntry, EngineId, Flavor, Fleet, Seat, WorkerId};

/// Ranks a request must not go to: those of engines that do not serve its front door, model or
/// route, and on a retry the ranks that failed it (every rank of an engine that failed at the
/// transport level). Engines and workers are named by their stable ids, so an `Avoid` made
/// against one version of the fleet means the same against the next. Empty (and
/// allocation-free) for the usual request.
#[derive(Debug, Clone, Default)]
pub struct Avoid {
    front: Front,
    /// When set, the only engines that may serve the request (sorted): those serving its model
    /// and route. An engine that joined after they were chosen is not among them.
    only: Option<Vec<EngineId>>,
    /// A few at most: one per failed attempt.
    pub(super) workers: Vec<WorkerId>,
    pub(super) engines: Vec<EngineId>,
    /// The request's model, when no known model list has it (only engines whose list is
    /// unknown may serve it): a failed pick then says so, naming the model.
    pub unlisted_model: Option<Arc<str>>,
    /// The LoRA adapter the request's model is: the pick prefers a rank running it, then one
    /// with a free adapter slot (`policy/adapters.rs`).
    pub adapter: Option<Arc<str>>,
    /// Which part of a request this pick is for: a whole request, or one leg of a
    /// disaggregated one (the prefill leg's ranks are scored by their prefill work).
    pub leg: Leg,
}

/// What a pick is for: a whole request, or one leg of a disaggregated one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Leg {
    #[default]
    Whole,
    Prefill,
    Decode,
}

impl Leg {
    pub fn as_str(self) -> &'static str {
        match self {
            Leg::Whole => "whole",
            Leg::Prefill => "prefill",
            Leg::Decode => "decode",
        }
    }
}

/// The front door a request came through; only engines serving it may take the request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Front {
    /// The OpenAI HTTP API (every engine with a `url`).
    #[default]
    Http,
    /// The gRPC service of this flavor (engines of the flavor with a `grpc_url`).
    Grpc(Flavor),
}

impl Front {
    pub fn served_by(self, e: &Engine) -> bool {
        match self {
            Front::Http => e.http,
            // Prefill and decode servers take their legs through the HTTP front door only:
            // the engines' gRPC services carry no KV transfer parameters.
            Front::Grpc(f) => e.grpc.is_some() && e.flavor == f && !e.role.disaggregated(),
        }
    }
}

impl Avoid {
    pub fn front(front: Front) -> Avoid {
        Avoid {
            front,
            ..Avoid::default()
        }
    }

    pub fn worker(&mut self, w: WorkerId) {
        self.workers.push(w);
    }

    pub fn engine(&mut self, e: EngineId) {
        self.engines.push(e);
    }

    /// Only these engines may serve the request.
    pub fn only(&mut self, mut engines: Vec<EngineId>) {
        engines.sort_unstable();
        self.only = Some(engines);
    }

    /// Whether every rank of `e` is ruled out.
    pub fn has_engine(&self, e: &EngineEntry) -> bool {
        !self.may_serve(e) || self.engines.contains(&e.key)
    }

    /// Whether `e` is of the engines the request may go to at all (its front door, model and
    /// route), failures aside.
    pub(super) fn may_serve(&self, e: &EngineEntry) -> bool {
        self.front.served_by(e)
            && (self.only.as_ref()).is_none_or(|o| o.binary_search(&e.key).is_ok())
    }

    /// Why `e` may not serve the request (for the explanation; `e` fails [`Avoid::may_serve`]).
    pub(super) fn why_not_serving(&self, e: &EngineEntry) -> &'static str {
        match (self.front.served_by(e), self.front, self.leg) {
            (false, Front::Http, _) => "not serving: its engine has no HTTP front door",
            (false, Front::Grpc(_), _) => {
                "not serving: its engine has no gRPC front door of this flavor (or serves one leg of disaggregated requests)"
            }
            (true, _, Leg::Prefill) => "not serving: not a prefill server of this request's model",
            (true, _, Leg::Decode) => "not serving: not a decode server of this request's model",
            (true, _, Leg::Whole) => {
                "not serving: its engine does not serve this request's model or route"
            }
        }
    }

    #[inline]
    fn blocks(&self, fleet: &Fleet, w: &Seat) -> bool {
        self.workers.contains(&w.key) || self.has_engine(&fleet.engines[w.engine])
    }
}

/// Whether worker `w` may be picked at all: not ejected (or due for its trial), not avoided.
#[inline]
pub(super) fn eligible(fleet: &Fleet, w: &Seat, avoid: &Avoid) -> bool {
    w.live.outlier.admit() != Admit::No && !avoid.blocks(fleet, w)
}
