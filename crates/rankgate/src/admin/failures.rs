//! A `/workers` row's `failures`: what its rank's failures are (the outlier record and the
//! gray-failure counters), so an operator sees why a rank is ejected or about to be.

use serde_json::{json, Value};

use crate::outlier::Cause;

/// What the rank's failures are: the kind of the current run (none after a success), how
/// much of it still weighs on its score, and its hung and abandoned requests so far.
pub(super) fn shown(w: &crate::worker::Member) -> Value {
    use std::sync::atomic::Ordering::Relaxed;
    let (o, c) = (&w.live.outlier, &w.counters);
    let failing = o.failures() > 0;
    // A short word for tools (`top`'s FAIL column): the status, or the kind of failure.
    let kind = match o.cause() {
        Cause::Status(s) => s.to_string(),
        Cause::Transport => "transport".into(),
        Cause::Timeout => "timeout".into(),
        Cause::Hung => "hung".into(),
        Cause::Mixed => "mixed".into(),
    };
    json!({
        "cause": failing.then(|| o.cause().to_string()),
        "kind": failing.then_some(kind),
        "recent": (o.recent_failures() * 100.0).round() / 100.0,
        "hung_requests": c.hung.load(Relaxed),
        "abandoned_before_first_byte": c.abandoned[0].load(Relaxed),
        "abandoned_mid_stream": c.abandoned[1].load(Relaxed),
    })
}
