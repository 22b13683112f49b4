//! How much of a typical request one request is, from its Content-Length against a running
//! mean: the weight `least_kv` credits a rank with until its next poll.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::table::UNIT_WEIGHT;

/// Weighs requests by body size against a running mean of recent sizes.
#[derive(Debug, Default)]
pub struct RequestSizer {
    /// Exponentially weighted mean of Content-Length, in sixteenths of a byte; 0 = none seen.
    mean_x16: AtomicU64,
}

impl RequestSizer {
    /// A request's weight in thousandths of a typical one: within [1/4, 32], and exactly one
    /// when its size is unknown (no Content-Length) or nothing has been seen yet.
    pub fn weight(&self, content_length: Option<u64>) -> u64 {
        let Some(len) = content_length.filter(|l| *l > 0) else {
            return UNIT_WEIGHT;
        };
        let x = len.saturating_mul(16);
        let mean = self.mean_x16.load(Relaxed);
        // Mean over roughly the last 32 requests. Load-then-store can lose an update under
        // contention; for an estimate that is cheaper than a compare-and-swap loop and harmless.
        let next = if mean == 0 {
            x
        } else {
            mean - mean / 32 + x / 32
        };
        self.mean_x16.store(next.max(1), Relaxed);
        if mean == 0 {
            return UNIT_WEIGHT;
        }
        (x.saturating_mul(UNIT_WEIGHT) / mean).clamp(UNIT_WEIGHT / 4, 32 * UNIT_WEIGHT)
    }
}
