//! The retry budget: over the last [`WINDOW`], retries may be at most `share` of the requests
//! plus a small floor, so when the whole fleet fails, retries cannot multiply the outage.
//!
//! tower's `TpsBudget` has the same contract but takes a mutex on every deposit (every request)
//! and turns the share into "one retry per ⌊1/share⌋ requests" (0.3 acts as 0.33, 0.6 as 1.0).
//! This one counts in per-second slots of relaxed atomics: no lock on the request path, and the
//! share is the configured one. A slot is recycled by the first request that finds it a window
//! old; a count lost to that race makes the budget off by one request, never unbounded.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::outlier::now_ms;

/// How far back the budget looks, in one-second slots.
const SLOTS: u64 = 10;
pub const WINDOW_SECS: u64 = SLOTS;
/// Retries per second allowed whatever the traffic, so a quiet router can still fail over.
pub const FLOOR_PER_SEC: u64 = 2;

#[derive(Debug, Default)]
struct Slot {
    /// Which second this slot counts (seconds since the clock's epoch, plus one; 0 = never).
    second: AtomicU64,
    requests: AtomicU64,
    retries: AtomicU64,
}

#[derive(Debug)]
pub struct RetryBudget {
    share: f64,
    slots: [Slot; SLOTS as usize],
}

impl RetryBudget {
    pub fn new(share: f64) -> RetryBudget {
        RetryBudget {
            share,
            slots: Default::default(),
        }
    }

    /// The slot for this second, emptied first if it still counts an older one.
    fn slot(&self, second: u64) -> &Slot {
        let s = &self.slots[(second % SLOTS) as usize];
        let seen = s.second.load(Relaxed);
        if seen != second
            && s.second
                .compare_exchange(seen, second, Relaxed, Relaxed)
                .is_ok()
        {
            s.requests.store(0, Relaxed);
            s.retries.store(0, Relaxed);
        }
        s
    }

    /// Counts one request.
    #[inline]
    pub fn deposit(&self) {
        self.slot(now_ms() / 1000 + 1)
            .requests
            .fetch_add(1, Relaxed);
    }

    /// Takes one retry from the budget, if it has one.
    pub fn withdraw(&self) -> bool {
        let second = now_ms() / 1000 + 1;
        let (mut requests, mut retries) = (0u64, 0u64);
        for s in &self.slots {
            let at = s.second.load(Relaxed);
            if at + SLOTS > second {
                requests += s.requests.load(Relaxed);
                retries += s.retries.load(Relaxed);
            }
        }
        let allowed = (self.share * requests as f64) as u64 + FLOOR_PER_SEC * WINDOW_SECS;
        if retries >= allowed {
            return false;
        }
        self.slot(second).retries.fetch_add(1, Relaxed);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn share_of_the_window_plus_the_floor_then_it_refills() {
        let b = RetryBudget::new(0.3);
        for _ in 0..100 {
            b.deposit();
        }
        let granted = (0..200).filter(|_| b.withdraw()).count();
        assert_eq!(granted, 30 + 20, "30% of 100 requests plus the floor of 20");
        // The same requests still count a few seconds later: nothing more yet.
        tokio::time::advance(Duration::from_secs(3)).await;
        assert!(!b.withdraw());
        // A window later they have aged out, and so have the retries: the floor is back.
        tokio::time::advance(Duration::from_secs(WINDOW_SECS)).await;
        let granted = (0..200).filter(|_| b.withdraw()).count();
        assert_eq!(granted, 20);
    }

    #[test]
    fn zero_share_leaves_only_the_floor() {
        let b = RetryBudget::new(0.0);
        for _ in 0..1000 {
            b.deposit();
        }
        assert_eq!((0..100).filter(|_| b.withdraw()).count(), 20);
    }
}
