//! A `/workers` row's `failures`: what its rank's failures are (the outlier record and the
//! gray-failure counters), so an operator sees why a rank is ejected or about to be.

use serde_json::{json, Value};

/// What the rank's failures are: the kind of the current run (none after a success), how
/// much of it still weighs on its score, and its hung and abandoned requests so far.
pub(super) fn shown(w: &crate::worker::Member) -> Value {
    use std::sync::atomic::Ordering::Relaxed;
    let (o, c) = (&w.live.outlier, &w.counters);
    json!({
        "cause": (o.failures() > 0).then(|| o.cause().to_string()),
        "recent": (o.recent_failures() * 100.0).round() / 100.0,
        "hung_requests": c.hung.load(Relaxed),
        "abandoned_before_first_byte": c.abandoned[0].load(Relaxed),
        "abandoned_mid_stream": c.abandoned[1].load(Relaxed),
    })
}
