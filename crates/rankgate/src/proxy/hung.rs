//! Gray failures seen from the request path: a request that gets no first byte (response
//! headers) long past the fleet's recent time to first byte is a failure of its rank
//! ([`Cause::Hung`]), whether rankgate's own timer sees it (`send` arms its one timer for the
//! bound first, then for the rest of `server.response_timeout`) or its client leaves after
//! waiting that long. The bound itself is [`crate::first_byte`], recomputed here off the
//! request path ([`watch_first_bytes`]).

use std::sync::Arc;

use tokio::time::Instant;

use super::guards::failure;
use super::target::Target;
use crate::first_byte::{Rule, Window, TICK};
use crate::metrics::Metrics;
use crate::outlier::{Cause, Policy};
use crate::worker::Role;

/// A request on `target` has waited past the bound without a first byte.
pub(super) fn judge(metrics: &Metrics, policy: Policy, target: &Target) {
    metrics.hung(&target.worker);
    failure(metrics, policy, target, Cause::Hung);
}

/// The client left a request on `target` that had no first byte yet, after it was sent at
/// `started`. `judged`: rankgate's timer already called it hung; `engine_busy`: it was still
/// waiting for one of rankgate's own connection slots, which says nothing of the rank.
pub(super) fn left_before_first_byte(
    metrics: &Metrics,
    policy: Policy,
    target: &Target,
    started: Option<Instant>,
    judged: bool,
    engine_busy: bool,
) {
    metrics.abandoned(&target.worker, false);
    // A decode leg is also dropped when its prefill fails (SGLang runs both at once): that is
    // no sign of the decode rank.
    if judged || engine_busy || target.worker.role == Role::Decode {
        return;
    }
    let (Some(started), Some(bound)) = (started, metrics.first_byte_bound.abandon()) else {
        return;
    };
    if started.elapsed() >= bound {
        judge(metrics, policy, target);
    }
}

/// Spawns the task that, every [`TICK`], reads the fleet's first-byte histograms and publishes
/// the bound under `routing.hung_factor` and `routing.hung_floor`, until `shutdown`.
pub fn watch_first_bytes(
    metrics: &Arc<Metrics>,
    routing: &crate::config::RoutingConfig,
    mut shutdown: crate::http::Shutdown,
) {
    let (metrics, rule) = (metrics.clone(), Rule::of(routing));
    tokio::spawn(async move {
        let mut window = Window::default();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = crate::http::shutdown_signalled(&mut shutdown) => return,
            }
            let p99 = window.push(metrics.first_byte_counts());
            metrics.first_byte_bound.set(p99, rule);
        }
    });
}
