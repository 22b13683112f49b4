//! Adapter affinity: where a request for a LoRA adapter goes among the ranks load allows. An
//! engine core runs at most `max_loras` distinct adapters at once; a request for another waits
//! there for a slot, and an adapter not in a slot is loaded first. So (`routing.adapter_affinity`,
//! on by default) among the ranks scoring
//! within `routing.affinity_margin` of the best (the margin prefix affinity uses: load is never
//! given up beyond it), the least loaded rank running the adapter now goes first, else the least
//! loaded with a free slot (`max_lora` as the engine's gauge says it, else `engines[].max_loras`,
//! else vLLM's default 1). Neither: the usual pick. What runs where is what this router has in
//! flight per rank ([`crate::adapters`]), and on a server of one rank what its gauge says too:
//! vLLM's gauge has no rank label.

use crate::config::DEFAULT_MAX_LORAS;
use crate::ix::WorkerIx;
use crate::worker::Fleet;

/// Among `scores` at most `limit`: the least loaded rank running `adapter`, else the least
/// loaded with a free adapter slot.
pub(super) fn adapter_pick(
    fleet: &Fleet,
    scores: &[(WorkerIx, f64)],
    adapter: &str,
    limit: f64,
) -> Option<WorkerIx> {
    // The least loaded rank of each kind, with its score.
    let mut running: Option<(WorkerIx, f64)> = None;
    let mut free: Option<(WorkerIx, f64)> = None;
    for &(w, s) in scores {
        if s > limit {
            continue;
        }
        let seat = &fleet.workers[w];
        let (here, distinct, said) = seat.member.adapters.state(adapter);
        let slots = (said.or(fleet.engines[seat.engine].max_loras)).unwrap_or(DEFAULT_MAX_LORAS);
        let best = match (here, distinct < slots as usize) {
            (true, _) => &mut running,
            (false, true) => &mut free,
            (false, false) => continue,
        };
        if best.is_none_or(|(_, b)| s < b) {
            *best = Some((w, s));
        }
    }
    running.or(free).map(|(w, _)| w)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::time::Instant;

    use super::super::avoid::Avoid;
    use super::super::tests::{available, routing, set, table};
    use crate::config::{NoTelemetry, Policy};
    use crate::policy::Selector;

    fn for_adapter(name: &str) -> Avoid {
        let mut avoid = Avoid::default();
        avoid.adapter = Some(Arc::from(name));
        avoid
    }

    #[test]
    fn an_adapter_goes_where_it_runs_then_where_a_slot_is_free_within_the_margin() {
        let t = table(3);
        let now = Instant::now();
        // Rank 0 is the least loaded; ranks 1 and 2 within the default margin (0.2) of it.
        set(
            &t,
            vec![
                available(0.1, now),
                available(0.2, now),
                available(0.25, now),
            ],
        );
        let s = Selector::new(&routing(Policy::LeastKv, NoTelemetry::Reject));
        let pick = |name: &str| s.pick(&t, None, &for_adapter(name)).unwrap();
        // Nothing runs anywhere: the least loaded rank has a free slot.
        let a = pick("a");
        assert_eq!(a.guard.worker(), 0);
        // `a` runs on rank 0 (one slot each, vLLM's default): `b` finds rank 0's slot taken
        // and goes to the least loaded rank with one free.
        let b = pick("b");
        assert_eq!(b.guard.worker(), 1);
        // Another `a` joins the one running, though rank 1 scores no worse.
        let a2 = pick("a");
        assert_eq!(a2.guard.worker(), 0);
        // Its requests ended: the adapter runs nowhere, and rank 0 is free again.
        drop((a, a2));
        let c = pick("c");
        assert_eq!(c.guard.worker(), 0);
        // Every rank within the margin busy with another adapter: the usual pick.
        let _d = pick("d");
        let e = pick("e");
        assert!(e.guard.worker() <= 2);
        drop(b);
    }

    #[test]
    fn load_is_never_given_up_beyond_the_margin() {
        let t = table(2);
        let now = Instant::now();
        set(&t, vec![available(0.1, now), available(0.6, now)]);
        let s = Selector::new(&routing(Policy::LeastKv, NoTelemetry::Reject));
        let busy = s.pick(&t, None, &for_adapter("other")).unwrap();
        assert_eq!(busy.guard.worker(), 0);
        // `a` would find a free slot on rank 1 only, 0.5 above the best: it goes to rank 0
        // (and waits there for the slot) rather than to a rank half full.
        let a = s.pick(&t, None, &for_adapter("a")).unwrap();
        assert_eq!(a.guard.worker(), 0);
    }

    #[test]
    fn off_an_adapter_is_picked_like_any_model() {
        let t = table(2);
        let now = Instant::now();
        set(&t, vec![available(0.1, now), available(0.15, now)]);
        let mut cfg = routing(Policy::LeastKv, NoTelemetry::Reject);
        cfg.adapter_affinity = false;
        cfg.tie_margin = 0.0;
        let s = Selector::new(&cfg);
        let _a = s.pick(&t, None, &for_adapter("a")).unwrap();
        // Rank 0 (0.12 with `a` credited) still scores best: `b` goes there, its slot or not.
        let b = s.pick(&t, None, &for_adapter("b")).unwrap();
        assert_eq!(b.guard.worker(), 0);
    }
}
