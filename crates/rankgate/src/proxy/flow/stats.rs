//! What flow control counts, per objective (a fixed, configured set: bounded labels) and for the
//! busiest tenants only (`flow.tenant_labels` of them, the rest summed as `other`): the
//! `/metrics` series and the admin `/flows` page.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use crate::metrics::histogram::Histogram;

use super::queue::Tenant;
use super::refusal::{Refusal, REASONS};

#[derive(Debug, Default)]
pub struct ObjectiveStats {
    pub queued: AtomicI64,
    pub dispatched: AtomicU64,
    /// Dispatched at once: the fleet had room and nothing was waiting.
    pub direct: AtomicU64,
    pub rejected: [AtomicU64; REASONS.len()],
    /// Time spent waiting, for requests that waited (sent or not).
    pub wait: Histogram,
}

impl ObjectiveStats {
    pub fn refused(&self, why: Refusal, waited: Option<Duration>) {
        self.rejected[why as usize].fetch_add(1, Relaxed);
        if let Some(d) = waited {
            self.wait.observe(d);
        }
    }
}

/// The busiest `n` tenants by tokens, and the others' sums (`tokens`, `in_flight`, `queued`).
pub fn busiest(tenants: &[Arc<Tenant>], n: usize) -> (Vec<Arc<Tenant>>, [u64; 3]) {
    let mut sorted: Vec<_> = tenants.to_vec();
    sorted.sort_by_key(|t| {
        std::cmp::Reverse((
            t.queued.load(Relaxed) as u64 + t.in_flight.load(Relaxed) as u64,
            t.tokens.load(Relaxed),
        ))
    });
    let rest = sorted.split_off(n.min(sorted.len()));
    let mut other = [0u64; 3];
    for t in &rest {
        other[0] += t.tokens.load(Relaxed);
        other[1] += t.in_flight.load(Relaxed) as u64;
        other[2] += t.queued.load(Relaxed) as u64;
    }
    (sorted, other)
}
