//! Engine health: the HTTP probe of an engine's health path and the consecutive-failure state
//! machine that turns probe results into a verdict.
//!
//! `/metrics` can keep answering from an engine whose scheduler is dead (vLLM's `/health` then
//! answers 503), so numbers alone do not prove an engine can serve. One failed probe is not a
//! verdict either (a saturated engine can miss one deadline): the engine turns unhealthy only
//! after `telemetry.health_failures` failures in a row, and the first success restores it.

use std::time::Duration;

use http_body_util::{BodyExt, Limited};

use super::client::HttpClient;
use crate::http::error_chain;
use crate::reason::HealthFailure;

/// Largest health body read; the body only needs draining so the connection can be reused.
const MAX_HEALTH_BYTES: usize = 64 * 1024;

/// Probes `uri` once: a 2xx answer within `timeout` is healthy.
pub async fn probe(
    http: HttpClient,
    uri: http::Uri,
    timeout: Duration,
) -> Result<(), HealthFailure> {
    let attempt = async {
        let resp = http
            .get(uri)
            .await
            .map_err(|e| HealthFailure::Transport(error_chain(&e)))?;
        let status = resp.status();
        Limited::new(resp.into_body(), MAX_HEALTH_BYTES)
            .collect()
            .await
            .map_err(|e| HealthFailure::Transport(format!("reading body: {e}")))?;
        if status.is_success() {
            Ok(())
        } else {
            Err(HealthFailure::Status(status))
        }
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err(HealthFailure::Timeout { after: timeout }),
    }
}

/// What one probe result changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    None,
    /// The failure that reached the threshold: log it once.
    TurnedUnhealthy,
    /// The first success after the engine was unhealthy.
    Recovered,
}

/// Consecutive-failure counting for one engine.
#[derive(Debug, Clone)]
pub struct Health {
    threshold: u32,
    failures: u32,
    last: Option<HealthFailure>,
}

impl Health {
    /// `threshold` consecutive failures make the engine unhealthy (config keeps it >= 1).
    pub fn new(threshold: u32) -> Health {
        Health {
            threshold: threshold.max(1),
            failures: 0,
            last: None,
        }
    }

    pub fn record(&mut self, result: Result<(), HealthFailure>) -> Change {
        let was = self.failing().is_some();
        match result {
            Ok(()) => {
                self.failures = 0;
                self.last = None;
            }
            Err(f) => {
                self.failures = self.failures.saturating_add(1);
                self.last = Some(f);
            }
        }
        match (was, self.failing().is_some()) {
            (false, true) => Change::TurnedUnhealthy,
            (true, false) => Change::Recovered,
            _ => Change::None,
        }
    }

    /// The latest failure, while the engine counts as unhealthy.
    pub fn failing(&self) -> Option<&HealthFailure> {
        self.last
            .as_ref()
            .filter(|_| self.failures >= self.threshold)
    }

    pub fn consecutive_failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    fn down() -> Result<(), HealthFailure> {
        Err(HealthFailure::Status(StatusCode::SERVICE_UNAVAILABLE))
    }

    #[test]
    fn unhealthy_only_after_threshold_and_back_on_first_success() {
        let mut h = Health::new(2);
        assert_eq!(h.record(down()), Change::None);
        assert!(h.failing().is_none(), "one failure is not a verdict");
        assert_eq!(h.record(Ok(())), Change::None);
        assert_eq!(h.consecutive_failures(), 0, "a success resets the count");
        assert_eq!(h.record(down()), Change::None);
        assert_eq!(h.record(down()), Change::TurnedUnhealthy);
        let timeout = HealthFailure::Timeout {
            after: Duration::from_millis(100),
        };
        assert_eq!(h.record(Err(timeout.clone())), Change::None);
        assert_eq!(h.failing(), Some(&timeout), "the latest failure is shown");
        assert_eq!(h.record(Ok(())), Change::Recovered);
        assert!(h.failing().is_none());
    }

    #[test]
    fn threshold_one_flips_at_once() {
        let mut h = Health::new(1);
        assert_eq!(h.record(down()), Change::TurnedUnhealthy);
        assert_eq!(h.record(Ok(())), Change::Recovered);
    }
}
