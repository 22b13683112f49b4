//! Outlier ejection: a rank that keeps failing requests is taken out of selection for a while.
//!
//! Telemetry cannot see a rank that answers every request with 503 while its `/metrics` looks
//! idle; to `least_kv` such a rank looks like the best one, so without this it would attract the
//! traffic. Each rank counts its consecutive failures (5xx and timeouts against the rank, transport
//! errors against every rank of the engine; 4xx and clients that left never count). Until it is
//! ejected its failures weigh on its score, fading over `eject_for` so that a rank kept off by
//! its penalty is tried again; past `routing.eject_after` it is ejected for
//! `routing.eject_for`, doubling with each ejection in a row up to [`MAX_EJECT_FOR`]. When that
//! runs out, exactly one request is let through as a trial: success re-admits the rank, failure
//! ejects it again for twice as long.
//!
//! A rank that hangs (its `/health` and `/metrics` answer, its requests never start) fails
//! as [`Cause::Hung`]: a request still without a first byte long past the fleet's recent time
//! to first byte, or one whose client left after waiting that long (`proxy/hung.rs`).
//!
//! The state is a handful of atomics beside each rank's live counters, so the request path reads
//! it with relaxed loads and no lock; only the rare transitions use compare-and-swap.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::MAX_EJECT_FOR;

/// How much one consecutive failure adds to a rank's `least_kv` score (in KV fraction), so a rank
/// that fails fast never looks like the idlest one even before it is ejected.
pub const FAILURE_WEIGHT: f64 = 0.25;

/// What a failed request ran into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The engine answered with this 5xx status.
    Status(u16),
    /// Connecting failed or the connection broke.
    Transport,
    /// No response headers within `server.response_timeout`, or a stream gone quiet.
    Timeout,
    /// A gray failure: no first byte (response headers) long past the fleet's own recent time
    /// to first byte, seen by rankgate's timer or by the client leaving (`proxy/hung.rs`).
    Hung,
    /// The consecutive failures were not all of one kind.
    Mixed,
}

impl Cause {
    fn encode(self) -> u32 {
        match self {
            Cause::Status(s) => s as u32,
            Cause::Transport => 1,
            Cause::Timeout => 2,
            Cause::Mixed => 3,
            Cause::Hung => 4,
        }
    }

    fn decode(v: u32) -> Cause {
        match v {
            1 => Cause::Transport,
            2 => Cause::Timeout,
            3 => Cause::Mixed,
            4 => Cause::Hung,
            s => Cause::Status(s as u16),
        }
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cause::Status(s) => write!(f, "{s}"),
            Cause::Transport => f.write_str("transport errors"),
            Cause::Timeout => f.write_str("timeouts"),
            Cause::Mixed => f.write_str("failures of mixed kinds"),
            Cause::Hung => f.write_str("requests with no first byte long past the fleet's"),
        }
    }
}

/// Whether a rank may take a request now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    Yes,
    /// Its ejection has run out: the next request is its trial.
    Trial,
    No,
}

/// An ejection in force, for `/workers` and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ejection {
    pub consecutive: u32,
    pub cause: Cause,
    /// How long this ejection lasts in all.
    pub length: Duration,
    /// Time left, zero once a trial is due or running.
    pub remaining: Duration,
}

impl fmt::Display for Ejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ejected: {} consecutive {} (for {} ms, ",
            self.consecutive,
            self.cause,
            self.length.as_millis(),
        )?;
        match self.remaining.as_millis() {
            0 => f.write_str("trial due)"),
            left => write!(f, "{left} ms left)"),
        }
    }
}

/// Ejection settings, from `[routing]`.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Consecutive failures that eject; 0 never ejects.
    pub after: u32,
    pub base: Duration,
}

/// Milliseconds since the process's first look at the clock; never 0, so 0 can mean "none".
pub(crate) fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    Instant::now().saturating_duration_since(epoch).as_millis() as u64 + 1
}

/// One rank's failure record.
#[derive(Debug, Default)]
pub struct State {
    consecutive: AtomicU32,
    /// Ejections in a row; sets the next ejection's length.
    ejections: AtomicU32,
    cause: AtomicU32,
    /// When the ejection runs out ([`now_ms`] scale); 0 = not ejected.
    until_ms: AtomicU64,
    length_ms: AtomicU64,
    trial: AtomicBool,
    /// When the last failure happened, and over how long its weight fades (`eject_for`).
    last_failure_ms: AtomicU64,
    fade_ms: AtomicU64,
}

impl State {
    /// What the current run of failures was (meaningless while [`State::failures`] is 0).
    pub fn cause(&self) -> Cause {
        Cause::decode(self.cause.load(Relaxed))
    }

    /// Consecutive failures so far (0 for a healthy rank).
    #[inline]
    pub fn failures(&self) -> u32 {
        self.consecutive.load(Relaxed)
    }

    /// Consecutive failures, faded by the time since the last one: the full count right after
    /// it, nothing once `eject_for` has passed. What the selector weighs.
    #[inline]
    pub fn recent_failures(&self) -> f64 {
        let n = self.consecutive.load(Relaxed);
        if n == 0 {
            return 0.0;
        }
        let age = now_ms().saturating_sub(self.last_failure_ms.load(Relaxed));
        let fade = self.fade_ms.load(Relaxed).max(1);
        n as f64 * (1.0 - (age as f64 / fade as f64)).max(0.0)
    }

    #[inline]
    pub fn admit(&self) -> Admit {
        let until = self.until_ms.load(Relaxed);
        if until == 0 {
            Admit::Yes
        } else if now_ms() < until || self.trial.load(Relaxed) {
            Admit::No
        } else {
            Admit::Trial
        }
    }

    /// Claims the trial of a rank whose ejection ran out; false if another request has it.
    pub fn start_trial(&self) -> bool {
        self.trial
            .compare_exchange(false, true, Relaxed, Relaxed)
            .is_ok()
    }

    /// A trial that ended without a verdict (the client left): the next request tries instead.
    pub fn abandon_trial(&self) {
        self.trial.store(false, Relaxed);
    }

    /// A request on this rank succeeded. Returns true when that ended an ejection.
    #[inline]
    pub fn success(&self) -> bool {
        if self.consecutive.load(Relaxed) != 0 {
            self.consecutive.store(0, Relaxed);
        }
        if self.until_ms.load(Relaxed) == 0 {
            return false;
        }
        self.until_ms.store(0, Relaxed);
        self.ejections.store(0, Relaxed);
        self.trial.store(false, Relaxed);
        true
    }

    /// A request on this rank failed. Returns the new ejection if this failure caused one.
    pub fn failure(&self, cause: Cause, policy: Policy) -> Option<Ejection> {
        let n = self.consecutive.fetch_add(1, Relaxed).saturating_add(1);
        // The reason names one kind of failure only when every one in the run was of it.
        let kind = match (n, Cause::decode(self.cause.load(Relaxed))) {
            (1, _) => cause,
            (_, before) if before == cause => cause,
            _ => Cause::Mixed,
        };
        self.cause.store(kind.encode(), Relaxed);
        self.last_failure_ms.store(now_ms(), Relaxed);
        self.fade_ms.store(policy.base.as_millis() as u64, Relaxed);
        if policy.after == 0 || n < policy.after {
            return None;
        }
        let until = self.until_ms.load(Relaxed);
        let failed_trial = until != 0
            && self
                .trial
                .compare_exchange(true, false, Relaxed, Relaxed)
                .is_ok();
        if until != 0 && !failed_trial {
            // Already ejected: a request that was in flight when it happened.
            return None;
        }
        let k = self.ejections.fetch_add(1, Relaxed).min(16);
        let length = policy.base.saturating_mul(1 << k).min(MAX_EJECT_FOR);
        let length_ms = length.as_millis() as u64;
        let next = now_ms() + length_ms;
        if self
            .until_ms
            .compare_exchange(until, next, Relaxed, Relaxed)
            .is_err()
        {
            return None;
        }
        self.length_ms.store(length_ms, Relaxed);
        Some(Ejection {
            consecutive: n,
            cause: kind,
            length,
            remaining: length,
        })
    }

    /// The ejection in force, if any.
    pub fn ejection(&self) -> Option<Ejection> {
        let until = self.until_ms.load(Relaxed);
        (until != 0).then(|| Ejection {
            consecutive: self.consecutive.load(Relaxed),
            cause: Cause::decode(self.cause.load(Relaxed)),
            length: Duration::from_millis(self.length_ms.load(Relaxed)),
            remaining: Duration::from_millis(until.saturating_sub(now_ms())),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: Policy = Policy {
        after: 3,
        base: Duration::from_millis(40),
    };

    #[test]
    fn ejects_after_consecutive_failures_and_success_resets() {
        let s = State::default();
        assert!(s.failure(Cause::Status(503), POLICY).is_none());
        assert!(s.failure(Cause::Status(503), POLICY).is_none());
        assert!(!s.success());
        assert_eq!(s.failures(), 0);
        s.failure(Cause::Status(503), POLICY);
        s.failure(Cause::Status(503), POLICY);
        let e = s
            .failure(Cause::Status(503), POLICY)
            .expect("third failure ejects");
        assert_eq!(e.length, Duration::from_millis(40));
        assert_eq!(s.admit(), Admit::No);
        let shown = s.ejection().unwrap().to_string();
        assert!(shown.starts_with("ejected: 3 consecutive 503"), "{shown}");
        // A straggler failing while ejected changes nothing.
        assert!(s.failure(Cause::Transport, POLICY).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn one_trial_then_doubling_or_readmission() {
        let s = State::default();
        for _ in 0..3 {
            s.failure(Cause::Timeout, POLICY);
        }
        tokio::time::advance(Duration::from_millis(41)).await;
        assert_eq!(s.admit(), Admit::Trial);
        assert!(s.start_trial());
        assert!(!s.start_trial(), "only one trial at a time");
        assert_eq!(s.admit(), Admit::No);
        // The trial fails: ejected again, for twice as long.
        let e = s
            .failure(Cause::Timeout, POLICY)
            .expect("failed trial ejects");
        assert_eq!(e.length, Duration::from_millis(80));
        tokio::time::advance(Duration::from_millis(81)).await;
        assert_eq!(s.admit(), Admit::Trial);
        assert!(s.start_trial());
        s.abandon_trial();
        assert_eq!(
            s.admit(),
            Admit::Trial,
            "an abandoned trial passes to the next request"
        );
        assert!(s.start_trial());
        assert!(s.success(), "a successful trial re-admits");
        assert_eq!(s.admit(), Admit::Yes);
        assert!(s.ejection().is_none());
        // The backoff starts over after a re-admission.
        for _ in 0..3 {
            s.failure(Cause::Timeout, POLICY);
        }
        assert_eq!(s.ejection().unwrap().length, Duration::from_millis(40));
    }

    #[tokio::test(start_paused = true)]
    async fn the_weight_of_failures_fades_over_eject_for() {
        let s = State::default();
        s.failure(Cause::Status(503), POLICY);
        s.failure(Cause::Status(503), POLICY);
        assert_eq!(s.recent_failures(), 2.0);
        tokio::time::advance(Duration::from_millis(20)).await;
        assert!(
            (s.recent_failures() - 1.0).abs() < 0.1,
            "{}",
            s.recent_failures()
        );
        tokio::time::advance(Duration::from_millis(21)).await;
        assert_eq!(s.recent_failures(), 0.0);
        // The count itself stands until a success: a third failure still ejects.
        assert!(s.failure(Cause::Status(503), POLICY).is_some());
    }

    #[test]
    fn a_run_of_different_failures_is_named_mixed() {
        let s = State::default();
        s.failure(Cause::Status(503), POLICY);
        s.failure(Cause::Status(503), POLICY);
        let e = s.failure(Cause::Timeout, POLICY).unwrap();
        assert_eq!(e.cause, Cause::Mixed);
        assert!(
            e.to_string()
                .starts_with("ejected: 3 consecutive failures of mixed kinds"),
            "{e}"
        );
        // After a success the next run starts clean.
        s.success();
        s.failure(Cause::Timeout, POLICY);
        assert_eq!(s.ejection(), None);
        assert_eq!(Cause::decode(s.cause.load(Relaxed)), Cause::Timeout);
    }

    #[test]
    fn hung_requests_eject_and_are_named() {
        let s = State::default();
        for _ in 0..2 {
            s.failure(Cause::Hung, POLICY);
        }
        assert_eq!(s.cause(), Cause::Hung);
        let e = s
            .failure(Cause::Hung, POLICY)
            .expect("third hung request ejects");
        assert!(
            e.to_string()
                .starts_with("ejected: 3 consecutive requests with no first byte"),
            "{e}"
        );
        assert_eq!(Cause::decode(Cause::Hung.encode()), Cause::Hung);
    }

    #[test]
    fn zero_never_ejects_and_length_is_capped() {
        let s = State::default();
        let never = Policy { after: 0, ..POLICY };
        for _ in 0..100 {
            assert!(s.failure(Cause::Status(500), never).is_none());
        }
        assert_eq!(s.failures(), 100);
        let s = State::default();
        s.ejections.store(40, Relaxed);
        let long = Policy {
            after: 1,
            base: Duration::from_secs(10),
        };
        assert_eq!(
            s.failure(Cause::Status(500), long).unwrap().length,
            MAX_EJECT_FOR
        );
    }
}
