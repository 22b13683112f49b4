//! What "reachable" means, the same in `/workers` and `check --probe`: the engine answered
//! (any HTTP answer, an error status included). Whether it may serve is its health, said apart:
//! an engine whose health path answers 503 is reachable but unhealthy, and takes no traffic.

use crate::reason::{HealthFailure, Reason};
use crate::table::RankView;

/// A rank's reachability and health, as `/workers` shows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reach {
    /// The engine answered its last poll or health probe.
    pub reachable: bool,
    /// `ok`, `unhealthy` (its health path failed: no traffic), or `unknown` (nothing answered).
    pub health: &'static str,
}

/// `view`'s reach, where `reason` is why the rank is unavailable, if it is.
pub fn of(view: &RankView, reason: Option<&Reason>) -> Reach {
    match reason {
        // The publisher marks an unhealthy engine unreachable so that no fallback picks it;
        // one that answered its health probe with a status is reachable all the same.
        Some(Reason::Unhealthy { failure, .. }) => Reach {
            reachable: view.reachable || matches!(failure, HealthFailure::Status(_)),
            health: "unhealthy",
        },
        _ if view.reachable => Reach {
            reachable: true,
            health: "ok",
        },
        _ => Reach {
            reachable: false,
            health: "unknown",
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_answering_503_is_reachable_but_unhealthy() {
        let view = RankView::initial();
        let status = Reason::Unhealthy {
            failure: HealthFailure::Status(http::StatusCode::SERVICE_UNAVAILABLE),
            sources: Vec::new(),
        };
        let r = of(&view, Some(&status));
        assert_eq!((r.reachable, r.health), (true, "unhealthy"));
        let silent = Reason::Unhealthy {
            failure: HealthFailure::Transport("connection refused".into()),
            sources: Vec::new(),
        };
        let r = of(&view, Some(&silent));
        assert_eq!((r.reachable, r.health), (false, "unhealthy"));
        assert_eq!(of(&view, None).health, "unknown");
        let up = RankView {
            reachable: true,
            ..RankView::initial()
        };
        assert_eq!(
            of(&up, None),
            Reach {
                reachable: true,
                health: "ok"
            }
        );
    }
}
