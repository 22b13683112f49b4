//! Why a rank has no usable telemetry: one [`Reason`] variant per kind of cause, each rendering
//! its own message.
//!
//! The router never parses these: the log compares variants (a new number in the same kind of
//! fault is not a new state), and `/workers` shows the rendered message beside [`Reason::kind`].
//! Low in the crate (it imports only `config`, for a source's kind) so the snapshot
//! ([`crate::table`]) and the pollers can both name it. Adding a cause is adding a variant, its
//! `Display` arm and its `kind`; nothing compares messages.

use std::fmt;
use std::time::Duration;

use crate::config::SourceKind;

/// Which report a rank was looked for in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportKind {
    /// Prometheus `/metrics`.
    Metrics,
    /// A native load report (gRPC `GetLoads`, `/v1/loads`).
    Loads,
}

/// One telemetry source's failure in one poll.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceFailure {
    /// The source's kind.
    pub source: SourceKind,
    pub problem: String,
}

impl fmt::Display for SourceFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.source, self.problem)
    }
}

/// Why one health probe failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealthFailure {
    /// The engine answered with a non-2xx status.
    Status(http::StatusCode),
    /// Connecting, sending or reading failed.
    Transport(String),
    /// Nothing answered within the poll timeout.
    Timeout { after: Duration },
}

impl fmt::Display for HealthFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HealthFailure::Status(s) => write!(f, "HTTP {s}"),
            HealthFailure::Transport(e) => f.write_str(e),
            HealthFailure::Timeout { after } => {
                write!(f, "no answer within {} ms", after.as_millis())
            }
        }
    }
}

/// Why a rank is Unavailable.
#[derive(Debug, Clone, PartialEq)]
pub enum Reason {
    /// The engine has not been polled yet (startup).
    NotPolled,
    /// The report answered but carries nothing for this rank.
    Absent { rank: u32, report: ReportKind },
    /// The report carries more than one entry for this rank: which one is true is unknowable.
    Duplicate { rank: u32, entries: usize },
    /// Numbers are present but unusable; `problem` says which and why. `rank` is `None` for a
    /// figure that is not one rank's (a gateway rollup).
    Invalid { rank: Option<u32>, problem: String },
    /// `/metrics` answered without a KV usage gauge (for this rank, or at all).
    NoKvGauge { rank: Option<u32> },
    /// A load report with no entries at all.
    EmptyReport { gateway: bool },
    /// An engine's load report turned out to be a gateway's fleet rollup.
    FleetRollup,
    /// Every configured telemetry source failed this poll.
    SourcesFailed { failures: Vec<SourceFailure> },
    /// The last sample is older than `stale_after`.
    Stale {
        age: Duration,
        stale_after: Duration,
    },
    /// The engine's health endpoint failed `telemetry.health_failures` times in a row.
    /// `sources` carries the telemetry failures too when the poll got no numbers either.
    Unhealthy {
        failure: HealthFailure,
        sources: Vec<SourceFailure>,
    },
    /// Taken out after consecutive request failures (see [`crate::outlier`]).
    Ejected(crate::outlier::Ejection),
    /// A fresh rank (named by its engine, no load gauges yet) that finished `served` requests
    /// from this router and still publishes no gauges: no longer fresh, just dark.
    Silent { served: u64 },
}

impl Reason {
    /// A stable machine name for the variant, for `/workers` and log fields.
    pub fn kind(&self) -> &'static str {
        match self {
            Reason::NotPolled => "not_polled",
            Reason::Absent { .. } => "absent",
            Reason::Duplicate { .. } => "duplicate",
            Reason::Invalid { .. } => "invalid",
            Reason::NoKvGauge { .. } => "no_kv_gauge",
            Reason::EmptyReport { .. } => "empty_report",
            Reason::FleetRollup => "fleet_rollup",
            Reason::SourcesFailed { .. } => "sources_failed",
            Reason::Stale { .. } => "stale",
            Reason::Unhealthy { .. } => "health",
            Reason::Ejected(_) => "ejected",
            Reason::Silent { .. } => "silent",
        }
    }

    /// Whether two reasons are the same kind of cause (same variant), whatever their numbers.
    pub fn same_kind(&self, other: &Reason) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

fn write_failures(f: &mut fmt::Formatter<'_>, failures: &[SourceFailure]) -> fmt::Result {
    f.write_str("every telemetry source failed: ")?;
    for (i, x) in failures.iter().enumerate() {
        if i > 0 {
            f.write_str("; ")?;
        }
        write!(f, "{x}")?;
    }
    Ok(())
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::NotPolled => f.write_str("no telemetry yet: engine not polled"),
            Reason::Absent {
                rank,
                report: ReportKind::Metrics,
            } => write!(f, "no series for rank {rank} in /metrics"),
            Reason::Absent {
                rank,
                report: ReportKind::Loads,
            } => write!(f, "rank {rank} absent from the loads report"),
            Reason::Duplicate { rank, entries } => {
                write!(f, "{entries} entries for rank {rank}: duplicate dp_rank")
            }
            Reason::Invalid {
                rank: Some(r),
                problem,
            } => write!(f, "rank {r}: invalid values: {problem}"),
            Reason::Invalid {
                rank: None,
                problem,
            } => write!(f, "invalid values: {problem}"),
            Reason::NoKvGauge { rank: Some(r) } => {
                write!(f, "rank {r}: KV usage gauge absent in /metrics")
            }
            Reason::NoKvGauge { rank: None } => f.write_str("no KV gauge in /metrics"),
            Reason::EmptyReport { gateway: false } => f.write_str("empty loads report"),
            Reason::EmptyReport { gateway: true } => f.write_str("the gateway reports no loads"),
            Reason::FleetRollup => f.write_str(
                "the report is a fleet rollup (entries carry `worker`), not this engine's DP ranks; configure it as flavor = \"gateway\"",
            ),
            Reason::SourcesFailed { failures } => write_failures(f, failures),
            Reason::Stale { age, stale_after } => write!(
                f,
                "stale: last sample {} ms old (stale_after {} ms)",
                age.as_millis(),
                stale_after.as_millis()
            ),
            Reason::Unhealthy { failure, sources } => {
                write!(f, "health: {failure}")?;
                if !sources.is_empty() {
                    f.write_str("; ")?;
                    write_failures(f, sources)?;
                }
                Ok(())
            }
            Reason::Ejected(e) => e.fmt(f),
            Reason::Silent { served } => write!(
                f,
                "served {served} requests and still publishes no load gauges (a fresh rank gets its gauges with its first request)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_renders_its_cause() {
        let prom = SourceFailure {
            source: SourceKind::Prometheus,
            problem: "connection refused".into(),
        };
        let cases = [
            (Reason::NotPolled, "no telemetry yet: engine not polled"),
            (
                Reason::Absent {
                    rank: 1,
                    report: ReportKind::Metrics,
                },
                "no series for rank 1 in /metrics",
            ),
            (
                Reason::Absent {
                    rank: 4,
                    report: ReportKind::Loads,
                },
                "rank 4 absent from the loads report",
            ),
            (
                Reason::Duplicate {
                    rank: 2,
                    entries: 3,
                },
                "3 entries for rank 2: duplicate dp_rank",
            ),
            (
                Reason::Invalid {
                    rank: Some(0),
                    problem: "token_usage is NaN".into(),
                },
                "rank 0: invalid values: token_usage is NaN",
            ),
            (Reason::NoKvGauge { rank: None }, "no KV gauge in /metrics"),
            (
                Reason::SourcesFailed {
                    failures: vec![
                        SourceFailure {
                            source: SourceKind::Grpc,
                            problem: "failed recently, probed in the background".into(),
                        },
                        prom.clone(),
                    ],
                },
                "every telemetry source failed: grpc: failed recently, probed in the background; prometheus: connection refused",
            ),
            (
                Reason::Stale {
                    age: Duration::from_millis(2500),
                    stale_after: Duration::from_secs(2),
                },
                "stale: last sample 2500 ms old (stale_after 2000 ms)",
            ),
            (
                Reason::Unhealthy {
                    failure: HealthFailure::Status(http::StatusCode::SERVICE_UNAVAILABLE),
                    sources: vec![],
                },
                "health: HTTP 503 Service Unavailable",
            ),
            (
                Reason::Unhealthy {
                    failure: HealthFailure::Timeout {
                        after: Duration::from_millis(300),
                    },
                    sources: vec![prom],
                },
                "health: no answer within 300 ms; every telemetry source failed: prometheus: connection refused",
            ),
            (
                Reason::Unhealthy {
                    failure: HealthFailure::Transport("connection reset".into()),
                    sources: vec![],
                },
                "health: connection reset",
            ),
            (
                Reason::Ejected(crate::outlier::Ejection {
                    cause: crate::outlier::Cause::Status(503),
                    consecutive: 5,
                    length: Duration::from_secs(10),
                    remaining: Duration::from_secs(4),
                }),
                "ejected: 5 consecutive 503 (for 10000 ms, 4000 ms left)",
            ),
            (
                Reason::Silent { served: 4 },
                "served 4 requests and still publishes no load gauges (a fresh rank gets its gauges with its first request)",
            ),
        ];
        for (reason, text) in cases {
            assert_eq!(reason.to_string(), text);
        }
    }

    #[test]
    fn kinds_compare_variants_not_numbers() {
        let a = Reason::Invalid {
            rank: Some(1),
            problem: "token_usage 1.2 outside [0, 1]".into(),
        };
        let b = Reason::Invalid {
            rank: Some(1),
            problem: "token_usage 1.3 outside [0, 1]".into(),
        };
        assert!(a.same_kind(&b));
        assert!(!a.same_kind(&Reason::NotPolled));
        assert_eq!(
            Reason::Unhealthy {
                failure: HealthFailure::Transport(String::new()),
                sources: vec![]
            }
            .kind(),
            "health"
        );
    }
}
