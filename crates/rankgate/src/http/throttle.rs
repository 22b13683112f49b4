//! A log line throttle, for failures that come in storms (failing accepts, a full front door,
//! 503s).

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Logs at most once per period, counting what it held back, so a storm of identical failures
/// (accept errors, 503s) is one line every few seconds instead of thousands.
#[derive(Debug)]
pub struct Throttle {
    period: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    pub fn new(period: Duration) -> Throttle {
        Throttle {
            period,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(suppressed)` when the caller should log now, with how many were held back since.
    pub fn allow(&self) -> Option<u64> {
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match s.0 {
            Some(last) if now.saturating_duration_since(last) < self.period => {
                s.1 += 1;
                None
            }
            _ => {
                let held = s.1;
                *s = (Some(now), 0);
                Some(held)
            }
        }
    }
}
