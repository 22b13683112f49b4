//! Fault knobs: the ways a real engine misbehaves that a router has to survive. Failing a share
//! of requests (or the first few), hanging requests or telemetry, a failing `/health`, stalling streams, and dying
//! outright. Each is set in [`super::SimConfig`] and flipped at run time through
//! [`super::SimEngine`]; values are checked here once for the library, `rankgate mock-engine`
//! and scenarios.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use http::{Response, StatusCode};

use super::{lock, Sim, SimBody, SimConfig};
use rankgate::http::{openai_error, shutdown_signalled};

/// A fault knob was given a value it cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct FaultError(String);

/// A status a fault may answer with: a real HTTP status, 100..=599.
pub fn check_status(status: u16) -> Result<StatusCode, FaultError> {
    if !(100..=599).contains(&status) {
        return Err(FaultError(format!(
            "status must be within 100..=599, got {status}"
        )));
    }
    StatusCode::from_u16(status).map_err(|e| FaultError(format!("status {status}: {e}")))
}

/// A share of requests, in percent.
pub fn check_percent(percent: f64) -> Result<f64, FaultError> {
    if !(0.0..=100.0).contains(&percent) {
        return Err(FaultError(format!(
            "percent must be within [0, 100], got {percent}"
        )));
    }
    Ok(percent)
}

/// Which requests fail. A counter rather than a coin makes the share exact and repeatable: at
/// p% request n fails when floor((n+1)p/100) passes floor(np/100), so 100% fails all, 50% every
/// second one.
#[derive(Debug)]
struct Fail {
    status: StatusCode,
    percent: f64,
    count: u64,
}

#[derive(Debug)]
pub(crate) struct Faults {
    fail: Mutex<Fail>,
    /// Proxied requests left to fail before the share applies (`fail_first`).
    fail_first: AtomicU64,
    pub(crate) hang_requests: AtomicBool,
    pub(crate) hang_metrics: AtomicBool,
    pub(crate) hang_models: AtomicBool,
    health: AtomicU16,
    /// Admissions left before the engine dies; `None` never.
    die_after: Mutex<Option<u64>>,
    stall_after: Mutex<Option<u64>>,
    pub(crate) received: AtomicU64,
    pub(crate) open: AtomicU64,
}

impl Faults {
    pub(crate) fn new(cfg: &SimConfig) -> Result<Faults, FaultError> {
        Ok(Faults {
            fail: Mutex::new(Fail {
                status: check_status(cfg.fail_status)?,
                percent: check_percent(cfg.fail_percent)?,
                count: 0,
            }),
            fail_first: AtomicU64::new(cfg.fail_first.unwrap_or(0)),
            hang_requests: AtomicBool::new(cfg.hang_requests),
            hang_metrics: AtomicBool::new(cfg.hang_metrics),
            hang_models: AtomicBool::new(cfg.hang_models),
            health: AtomicU16::new(check_status(cfg.health_status)?.as_u16()),
            die_after: Mutex::new(cfg.die_after),
            stall_after: Mutex::new(cfg.stall_after_tokens),
            received: AtomicU64::new(0),
            open: AtomicU64::new(0),
        })
    }

    pub(crate) fn set_fail(&self, status: u16, percent: f64) -> Result<(), FaultError> {
        let (status, percent) = (check_status(status)?, check_percent(percent)?);
        // A fresh count, so a test that sets 50% sees the same pattern whatever ran before.
        *lock(&self.fail) = Fail {
            status,
            percent,
            count: 0,
        };
        Ok(())
    }

    /// The status this request fails with, if it is one of the failing share.
    pub(crate) fn failing(&self) -> Option<StatusCode> {
        let first = self
            .fail_first
            .fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1));
        if first.is_ok() {
            return Some(lock(&self.fail).status);
        }
        let mut f = lock(&self.fail);
        if f.percent <= 0.0 {
            return None;
        }
        let n = f.count as f64;
        f.count += 1;
        let share = |k: f64| (k * f.percent / 100.0).floor();
        (share(n + 1.0) > share(n)).then_some(f.status)
    }

    /// The next `n` proxied requests fail with the failing status, before the share applies.
    pub(crate) fn set_fail_first(&self, n: u64) {
        self.fail_first.store(n, Relaxed);
    }

    pub(crate) fn set_health(&self, status: u16) -> Result<(), FaultError> {
        self.health.store(check_status(status)?.as_u16(), Relaxed);
        Ok(())
    }

    pub(crate) fn health(&self) -> StatusCode {
        StatusCode::from_u16(self.health.load(Relaxed)).unwrap_or(StatusCode::OK)
    }

    pub(crate) fn set_die_after(&self, n: Option<u64>) {
        *lock(&self.die_after) = n;
    }

    pub(crate) fn set_stall_after(&self, k: Option<u64>) {
        *lock(&self.stall_after) = k;
    }

    /// Whether a request that has sent `sent` tokens stalls now.
    pub(crate) fn stalls_at(&self, sent: u64) -> bool {
        lock(&self.stall_after).is_some_and(|k| sent >= k)
    }
}

/// Counts a proxied request as open (see [`super::SimEngine::open_requests`]) while alive.
pub(crate) struct Open(Arc<Sim>);

impl Open {
    pub(crate) fn new(sim: &Arc<Sim>) -> Open {
        sim.faults.open.fetch_add(1, Relaxed);
        Open(sim.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.faults.open.fetch_sub(1, Relaxed);
    }
}

impl Sim {
    /// Dies like a process under `kill -9`: every server closes its listener and drops its
    /// connections at once.
    pub(crate) fn kill(&self) {
        self.kill.send_replace(true);
        // A killed process's KV-event sockets close with it.
        self.kv_stop.send_replace(true);
    }

    pub(crate) fn is_dead(&self) -> bool {
        *self.kill.borrow()
    }

    /// Counts one admission into a rank, dying when `die_after` runs out.
    pub(crate) fn admitted(&self) {
        let die = {
            let mut left = lock(&self.faults.die_after);
            match left.as_mut() {
                Some(n) => {
                    *n = n.saturating_sub(1);
                    *n == 0
                }
                None => false,
            }
        };
        if die {
            self.kill();
        }
    }

    /// Never answers, until the engine shuts down. A client that leaves drops the waiting future
    /// with its connection, and a kill drops the connection, so only a graceful shutdown needs a
    /// way out: without it the drain would wait its full grace for requests that never end.
    pub(crate) async fn hold(&self) -> Response<SimBody> {
        let mut shutdown = self.shutdown.clone();
        shutdown_signalled(&mut shutdown).await;
        openai_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailableError",
            "engine shutting down",
        )
    }

    /// The injected failure for this proxied request, if it is one of the failing share.
    pub(crate) fn injected_failure(&self) -> Option<Response<SimBody>> {
        let status = self.faults.failing()?;
        let kind = match status.as_u16() {
            400 => "BadRequestError",
            401 => "AuthenticationError",
            403 => "PermissionDeniedError",
            404 => "NotFoundError",
            429 => "RateLimitError",
            503 => "ServiceUnavailableError",
            500..=599 => "InternalServerError",
            _ => "APIError",
        };
        Some(openai_error(
            status,
            kind,
            &format!("simulated failure ({})", status.as_u16()),
        ))
    }
}
