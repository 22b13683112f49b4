//! The `[telemetry]` table: how often engines are polled, when their numbers go stale, and
//! how many failed health probes make an engine unhealthy; each bound a named constant.

use std::time::Duration;

use serde::Deserialize;

use super::duration::HumanDuration;
use super::error::{invalid, ConfigError};

pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(250);
pub const DEFAULT_STALE_AFTER: Duration = Duration::from_secs(2);
/// Consecutive failed health probes before an engine's ranks are Unavailable: one missed probe
/// on a saturated engine is not a verdict.
pub const DEFAULT_HEALTH_FAILURES: u32 = 2;
/// Polling faster than this only loads the engines; slower than [`MAX_INTERVAL`] routes on
/// numbers too old to mean anything.
pub const MIN_INTERVAL: Duration = Duration::from_millis(10);
pub const MAX_INTERVAL: Duration = Duration::from_secs(60);
/// A poll timeout under this fails against any real engine (a loaded vLLM takes seconds).
pub const MIN_TIMEOUT: Duration = Duration::from_millis(10);
/// Beyond this a rank's numbers are history, not load.
pub const MAX_STALE_AFTER: Duration = Duration::from_secs(3600);
/// Polls in flight at once, per lane (engines that answer; engines not reached): bounds the
/// sockets and the share of the runtime a huge fleet of dead engines can take.
pub const DEFAULT_MAX_CONCURRENT_POLLS: usize = 256;
/// Beyond this the bound bounds nothing a machine has (each poll holds a socket or two).
pub const MAX_MAX_CONCURRENT_POLLS: usize = 65_536;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTelemetry {
    interval: Option<HumanDuration>,
    stale_after: Option<HumanDuration>,
    timeout: Option<HumanDuration>,
    health_failures: Option<u32>,
    max_concurrent_polls: Option<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryConfig {
    pub interval: Duration,
    pub stale_after: Duration,
    /// Longest one poll of one engine may take; a slow engine only delays its own ranks.
    pub timeout: Duration,
    /// Consecutive failed health probes before an engine counts as unhealthy (>= 1).
    pub health_failures: u32,
    /// Polls in flight at once, in each of the two lanes (`telemetry::budget`).
    pub max_concurrent_polls: usize,
}

/// The `[telemetry]` table, with its bounds: each limit is a named constant above.
pub(super) fn telemetry_config(raw: RawTelemetry) -> Result<TelemetryConfig, ConfigError> {
    let interval = raw.interval.map_or(DEFAULT_INTERVAL, |d| d.0);
    let stale_after = raw.stale_after.map_or(DEFAULT_STALE_AFTER, |d| d.0);
    if !(MIN_INTERVAL..=MAX_INTERVAL).contains(&interval) {
        return Err(invalid(
            "telemetry.interval",
            format!("{interval:?} must be between {MIN_INTERVAL:?} and {MAX_INTERVAL:?}"),
        ));
    }
    if stale_after > MAX_STALE_AFTER {
        return Err(invalid(
            "telemetry.stale_after",
            format!("{stale_after:?} must be at most {MAX_STALE_AFTER:?}"),
        ));
    }
    if stale_after <= interval {
        return Err(invalid(
            "telemetry.stale_after",
            format!(
                "{stale_after:?} must be longer than telemetry.interval ({interval:?}), or every rank goes stale between polls"
            ),
        ));
    }
    let timeout = raw.timeout.map_or(stale_after, |d| d.0);
    if timeout < MIN_TIMEOUT {
        return Err(invalid(
            "telemetry.timeout",
            format!("{timeout:?} must be at least {MIN_TIMEOUT:?}"),
        ));
    }
    let health_failures = raw.health_failures.unwrap_or(DEFAULT_HEALTH_FAILURES);
    if health_failures == 0 {
        return Err(invalid(
            "telemetry.health_failures",
            "must be at least 1 (disable probes per engine with health_path = \"\")",
        ));
    }
    let max_concurrent_polls = raw
        .max_concurrent_polls
        .unwrap_or(DEFAULT_MAX_CONCURRENT_POLLS);
    if !(1..=MAX_MAX_CONCURRENT_POLLS).contains(&max_concurrent_polls) {
        return Err(invalid(
            "telemetry.max_concurrent_polls",
            format!("{max_concurrent_polls} must be between 1 and {MAX_MAX_CONCURRENT_POLLS}"),
        ));
    }
    Ok(TelemetryConfig {
        interval,
        stale_after,
        timeout,
        health_failures,
        max_concurrent_polls,
    })
}
