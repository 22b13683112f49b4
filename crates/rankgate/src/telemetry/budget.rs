//! The polls' budget: how many polls run at once, and how fast engines that do not answer are
//! polled, so a fleet of thousands of dead engines costs a bounded share of the runtime and of
//! the sockets, and never delays the polls of engines that answer.
//!
//! Two lanes, each of `telemetry.max_concurrent_polls` polls in flight:
//! - engines whose last poll reached them poll at their interval, waiting only for one another;
//! - the rest (engines not polled yet, unreachable ones, ones that do not say their shape) also
//!   wait for a start slot: [`UNREACHED_POLLS_PER_SECOND`] across the fleet, first come first
//!   served. A small fleet never waits for one (a second's worth may start at once); 20,000 dead
//!   engines are each polled every 20 s or so instead of every 250 ms, and an engine among them
//!   that starts answering moves to the first lane at its next poll.
//!
//! A permit is held for one whole poll step (shape question, sources, health probe), so the
//! sockets a lane holds are bounded by its size (a blackholed address holds its socket until the
//! poll's timeout).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// Poll starts a second for engines not reached, across the fleet: each is a connection attempt
/// or two, so this bounds what dead engines cost (well under a core) whatever their number.
pub const UNREACHED_POLLS_PER_SECOND: u32 = 1_000;
/// How often the start slots are refilled.
const REFILL_EVERY: Duration = Duration::from_millis(10);
/// Consecutive polls that did not reach an engine before it polls in the unreached lane (an
/// engine never reached starts there): one missed poll of a live engine is not a verdict.
pub const MISSES_TO_UNREACHED: u32 = 3;

/// Shared by every poller of one publisher.
#[derive(Debug)]
pub struct Budget {
    answering: Arc<Semaphore>,
    unreached: Arc<Semaphore>,
    /// Start slots of the unreached lane, refilled by [`Budget::refill`] up to a second's worth
    /// (a small fleet never waits for one). A waiter that goes (its engine left the fleet)
    /// leaves the queue and takes no slot.
    starts: Semaphore,
    /// Told when a start slot is taken: the refill sleeps while the slots are full, so a fleet
    /// whose engines all answer costs no timer wake-ups (100 a second, otherwise, for nothing).
    drawn: Notify,
    per_second: u32,
}

impl Budget {
    pub fn new(max_concurrent: usize) -> Arc<Budget> {
        Budget::with_pace(max_concurrent, UNREACHED_POLLS_PER_SECOND)
    }

    fn with_pace(max_concurrent: usize, per_second: u32) -> Arc<Budget> {
        let max = max_concurrent.clamp(1, Semaphore::MAX_PERMITS);
        let per_second = per_second.max(1);
        Arc::new(Budget {
            answering: Arc::new(Semaphore::new(max)),
            unreached: Arc::new(Semaphore::new(max)),
            starts: Semaphore::new(per_second as usize),
            drawn: Notify::new(),
            per_second,
        })
    }

    /// Waits for a place for one poll of an engine that `answering` (reached lately) or not;
    /// the poll holds the permit until it ends. `None` only if the budget is closed (never).
    pub async fn enter(&self, answering: bool) -> Option<OwnedSemaphorePermit> {
        if answering {
            return self.answering.clone().acquire_owned().await.ok();
        }
        self.starts.acquire().await.ok()?.forget();
        self.drawn.notify_one();
        self.unreached.clone().acquire_owned().await.ok()
    }

    /// Adds the start slots of one [`REFILL_EVERY`], up to a second's worth.
    fn top_up(&self, slots: usize) {
        let room = (self.per_second as usize).saturating_sub(self.starts.available_permits());
        self.starts.add_permits(slots.min(room));
    }

    /// Refills the start slots at [`UNREACHED_POLLS_PER_SECOND`] until dropped (the publisher
    /// runs it among its tasks).
    pub async fn refill(self: Arc<Budget>) {
        let mut tick = tokio::time::interval(REFILL_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let ticks_per_second =
            (Duration::from_secs(1).as_millis() / REFILL_EVERY.as_millis()) as u32;
        let per_tick = (self.per_second / ticks_per_second).max(1) as usize;
        loop {
            if self.starts.available_permits() >= self.per_second as usize {
                // Full: nothing to add until a slot is taken (a stored notification covers one
                // taken meanwhile), then a refill from then on.
                self.drawn.notified().await;
                tick.reset();
            }
            tick.tick().await;
            self.top_up(per_tick);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn unreached_engines_are_paced_after_a_burst_and_answering_ones_are_not() {
        let b = Budget::with_pace(64, 200);
        // A second's worth starts at once...
        for _ in 0..200 {
            drop(b.enter(false).await.unwrap());
        }
        // ...then the next waits for the refill (2 a tick at 200 a second).
        let waiting = tokio::time::timeout(Duration::from_millis(50), b.enter(false)).await;
        assert!(waiting.is_err(), "no slot before a refill");
        tokio::spawn(b.clone().refill());
        let started = tokio::time::Instant::now();
        assert!(b.enter(false).await.is_some());
        assert!(started.elapsed() <= REFILL_EVERY * 2);
        // The answering lane is bounded in concurrency only.
        let mut held = Vec::new();
        for _ in 0..64 {
            held.push(b.enter(true).await.unwrap());
        }
        assert_eq!(b.answering.available_permits(), 0);
        assert!(tokio::time::timeout(Duration::from_secs(1), b.enter(true))
            .await
            .is_err());
        drop(held);
        assert_eq!(b.answering.available_permits(), 64);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refill_that_slept_while_full_wakes_when_slots_are_taken() {
        let b = Budget::with_pace(64, 200);
        tokio::spawn(b.clone().refill());
        // Full for a while: the refill waits for a slot to be taken.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(b.starts.available_permits(), 200);
        for _ in 0..200 {
            drop(b.enter(false).await.unwrap());
        }
        let started = tokio::time::Instant::now();
        assert!(b.enter(false).await.is_some());
        assert!(
            started.elapsed() <= REFILL_EVERY * 2,
            "{:?}",
            started.elapsed()
        );
        // Refilled on up to a second's worth, then asleep again.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(b.starts.available_permits(), 200);
    }
}
