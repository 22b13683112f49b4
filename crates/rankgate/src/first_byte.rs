//! The fleet's first-byte bound: how long a request may wait for its engine's first byte (the
//! response headers) before it is taken for hung (a gray failure, [`crate::outlier::Cause::Hung`]).
//!
//! A rank can hang while its `/health` and `/metrics` answer: telemetry sees nothing wrong and
//! its requests never start. What gives it away is time: its requests wait far longer than the
//! rest of the fleet's. The bound is therefore relative to the fleet's own recent time to first
//! byte (the p99 over the last [`WINDOW`] of `rankgate_time_to_first_byte_seconds`, every model
//! together) times `routing.hung_factor`, and never below `routing.hung_floor`, so a fleet that is
//! slow as a whole (long prompts, answers that are not streamed) is slow for everyone and judged by
//! its own pace, and a rank only a little slower than its peers is never called hung. Requests that
//! never got a first byte are not in the histogram, so a hung rank cannot raise its own bound.
//!
//! With too few first bytes in the window (fewer than [`MIN_SAMPLES`]) there are no peers to
//! compare with and nothing is judged: a fleet where every rank hangs gains nothing from
//! ejecting them all.
//!
//! A client that leaves before its first byte is a weaker sign (it may just be impatient), so it
//! counts once it waited past the factor times the fleet's p99 (not below [`ABANDON_FLOOR`]),
//! without `hung_floor`: clients that give up after 2 s on a rank whose peers answer in 50 ms say
//! the rank is hung even when rankgate's own timer (held to the floor) has not fired yet.
//!
//! The bound is computed off the request path every [`TICK`] and published in atomics; a request
//! reads one of them when it is sent.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::metrics::histogram::BUCKETS;

/// How often the bound is recomputed.
pub const TICK: Duration = Duration::from_millis(500);
/// The stretch of recent first bytes the fleet's typical time is read from.
pub const WINDOW: Duration = Duration::from_secs(30);
/// First bytes the window must hold before anything is judged.
pub const MIN_SAMPLES: u64 = 5;
/// The least a client must have waited for its leaving to count against the rank.
pub const ABANDON_FLOOR: Duration = Duration::from_millis(100);

/// Buckets of the first-byte histogram, `+Inf` last.
pub const SLOTS: usize = BUCKETS.len() + 1;

/// `routing.hung_factor` and `routing.hung_floor`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rule {
    /// The bound in multiples of the fleet's p99 time to first byte; 0 judges nothing.
    pub factor: f64,
    pub floor: Duration,
}

impl Rule {
    pub fn of(routing: &crate::config::RoutingConfig) -> Rule {
        Rule {
            factor: routing.hung_factor,
            floor: routing.hung_floor,
        }
    }
}

/// The bounds in force, in milliseconds (0: none, nothing is judged).
#[derive(Debug, Default)]
pub struct Bound {
    typical_ms: AtomicU64,
    stall_ms: AtomicU64,
    abandon_ms: AtomicU64,
}

fn of_ms(ms: u64) -> Option<Duration> {
    (ms != 0).then(|| Duration::from_millis(ms))
}

impl Bound {
    /// How long a request may wait for its first byte before rankgate's timer calls it hung.
    #[inline]
    pub fn stall(&self) -> Option<Duration> {
        of_ms(self.stall_ms.load(Relaxed))
    }

    /// How long a client must have waited before its leaving counts against the rank.
    pub fn abandon(&self) -> Option<Duration> {
        of_ms(self.abandon_ms.load(Relaxed))
    }

    /// The fleet's recent p99 time to first byte, when the window holds enough of them.
    pub fn typical(&self) -> Option<Duration> {
        of_ms(self.typical_ms.load(Relaxed))
    }

    /// Publishes the bounds for the fleet's p99 `typical` under `rule`.
    pub fn set(&self, typical: Option<Duration>, rule: Rule) {
        let ms = |d: Duration| (d.as_millis() as u64).max(1);
        let (t, stall, abandon) = match typical {
            Some(t) if rule.factor > 0.0 => {
                let scaled = t.mul_f64(rule.factor);
                (
                    ms(t),
                    ms(scaled.max(rule.floor)),
                    ms(scaled.max(ABANDON_FLOOR)),
                )
            }
            Some(t) => (ms(t), 0, 0),
            None => (0, 0, 0),
        };
        self.typical_ms.store(t, Relaxed);
        self.stall_ms.store(stall, Relaxed);
        self.abandon_ms.store(abandon, Relaxed);
    }
}

/// The first-byte histogram's recent counts: the differences between successive reads of its
/// cumulative buckets over the last [`WINDOW`].
#[derive(Debug, Default)]
pub struct Window {
    last: Option<[u64; SLOTS]>,
    deltas: VecDeque<[u64; SLOTS]>,
    sum: [u64; SLOTS],
}

impl Window {
    /// Takes the histogram's cumulative bucket counts as read now; returns the p99 of the
    /// window's first bytes (a bucket's upper bound), or `None` with fewer than [`MIN_SAMPLES`].
    pub fn push(&mut self, counts: [u64; SLOTS]) -> Option<Duration> {
        let mut delta = [0u64; SLOTS];
        if let Some(last) = &self.last {
            for (i, d) in delta.iter_mut().enumerate() {
                // A model's series may leave the page (its histogram is dropped): never negative.
                *d = counts[i].saturating_sub(last[i]);
            }
        }
        self.last = Some(counts);
        let keep = (WINDOW.as_millis() / TICK.as_millis()) as usize;
        if self.deltas.len() == keep {
            if let Some(old) = self.deltas.pop_front() {
                for (s, o) in self.sum.iter_mut().zip(old) {
                    *s -= o;
                }
            }
        }
        for (s, d) in self.sum.iter_mut().zip(delta) {
            *s += d;
        }
        self.deltas.push_back(delta);
        let total: u64 = self.sum.iter().sum();
        if total < MIN_SAMPLES {
            return None;
        }
        // The first bucket holding 99% of the window.
        let want = total - total / 100;
        let mut seen = 0;
        for (i, n) in self.sum.iter().enumerate() {
            seen += n;
            if seen >= want {
                let secs = BUCKETS
                    .get(i)
                    .copied()
                    .unwrap_or(BUCKETS[BUCKETS.len() - 1] * 2.0);
                return Some(Duration::from_secs_f64(secs));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: Rule = Rule {
        factor: 4.0,
        floor: Duration::from_secs(1),
    };

    fn at(bucket: usize, n: u64, counts: &mut [u64; SLOTS]) -> [u64; SLOTS] {
        counts[bucket] += n;
        *counts
    }

    #[test]
    fn the_p99_of_the_window_sets_the_bounds_with_their_floors() {
        let mut w = Window::default();
        let mut c = [0; SLOTS];
        assert_eq!(w.push(c), None, "no first bytes yet");
        // 4 fast ones: too few to judge.
        assert_eq!(w.push(at(5, 4, &mut c)), None);
        // 100 in the 50 ms bucket, one slow: the p99 is still 50 ms.
        assert_eq!(w.push(at(5, 96, &mut c)), Some(Duration::from_millis(50)));
        let p = w.push(at(9, 1, &mut c));
        assert_eq!(p, Some(Duration::from_millis(50)));
        let b = Bound::default();
        b.set(p, RULE);
        assert_eq!(b.stall(), Some(Duration::from_secs(1)), "the floor");
        assert_eq!(b.abandon(), Some(Duration::from_millis(200)));
        assert_eq!(b.typical(), Some(Duration::from_millis(50)));
        // A slow fleet: its own pace, times the factor.
        b.set(Some(Duration::from_secs(5)), RULE);
        assert_eq!(b.stall(), Some(Duration::from_secs(20)));
        // Factor 0: nothing judged.
        b.set(
            p,
            Rule {
                factor: 0.0,
                ..RULE
            },
        );
        assert_eq!((b.stall(), b.abandon()), (None, None));
        b.set(None, RULE);
        assert_eq!(b.typical(), None);
    }

    #[test]
    fn old_first_bytes_leave_the_window() {
        let mut w = Window::default();
        let mut c = [0; SLOTS];
        w.push(c);
        assert!(w.push(at(12, 50, &mut c)).is_some());
        let ticks = (WINDOW.as_millis() / TICK.as_millis()) as usize;
        for _ in 0..ticks - 1 {
            assert_eq!(w.push(c), Some(Duration::from_secs(10)));
        }
        assert_eq!(w.push(c), None, "the window has moved past them");
    }
}
