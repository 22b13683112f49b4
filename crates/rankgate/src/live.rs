//! The counters of one worker that change with every request (dispatched, completed, their
//! weights, outlier state): below both the fleet, whose members own them, and the snapshot that
//! reads them.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The weight of a request of typical size; a request's weight is its size relative to that,
/// in thousandths, so integer atomics can carry it.
pub const UNIT_WEIGHT: u64 = 1000;

/// Counters of one worker that change per request.
#[derive(Debug, Default)]
#[repr(align(64))]
pub struct Live {
    /// Requests ever sent to this worker.
    pub dispatched: AtomicU64,
    /// Requests whose response body has ended (or failed).
    pub completed: AtomicU64,
    /// The same two, each request counted by its weight (see [`UNIT_WEIGHT`]).
    pub dispatched_weight: AtomicU64,
    pub completed_weight: AtomicU64,
    /// Consecutive failures and ejection (see [`crate::outlier`]).
    pub outlier: crate::outlier::State,
}

impl Live {
    /// Weight of the requests in flight.
    #[inline]
    pub fn in_flight_weight(&self) -> u64 {
        let done = self.completed_weight.load(Relaxed);
        self.dispatched_weight.load(Relaxed).saturating_sub(done)
    }

    #[inline]
    pub fn in_flight(&self) -> u64 {
        // Read `completed` first: a completion racing between the two loads then can only make
        // the result one too high, never wrap below zero.
        let done = self.completed.load(Relaxed);
        self.dispatched.load(Relaxed).saturating_sub(done)
    }
}
