//! Prefix affinity (`routing.prefix_affinity`): among the ranks load allows, the one that was
//! sent the longest leading run of the prompt.

use crate::ix::WorkerIx;
use crate::worker::Fleet;

/// Among `scores` at most `limit` and below `max_kv`, the rank holding the longest leading run
/// of `prompt`'s chunks (the lower score between equal runs); `None` when none holds any.
pub(super) fn longest_prefix(
    fleet: &Fleet,
    scores: &[(WorkerIx, f64)],
    prompt: &[u64],
    limit: f64,
    max_kv: f64,
) -> Option<WorkerIx> {
    let mut best: Option<(WorkerIx, usize, f64)> = None;
    for &(w, s) in scores {
        if s > limit || s >= max_kv {
            continue;
        }
        let run = fleet.workers[w].prefixes.matched(prompt);
        let better = match best {
            None => run > 0,
            Some((_, r, bs)) => run > r || (run == r && s < bs),
        };
        if better {
            best = Some((w, run, s));
        }
    }
    best.map(|(w, _, _)| w)
}
