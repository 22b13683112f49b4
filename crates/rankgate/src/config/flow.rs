//! The `[flow]` table: flow control. When every rank a request may use is saturated, rankgate
//! holds the request and dispatches it later, by its objective's priority and fairly between
//! tenants; off (the default), requests go to their rank at once, as they always did.
//!
//! The saturation limits live here too: they judge a rank from the telemetry rankgate already
//! has (its waiting queue, its KV with the work sent since the poll, the requests in flight).

use std::time::Duration;

use serde::Deserialize;

use super::duration::{duration, ms, secs, HumanDuration};
use super::error::{invalid, ConfigError};

pub const DEFAULT_TENANT_HEADER: &str = "x-gateway-inference-fairness-id";
pub const DEFAULT_OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// A client's own bound on its wait, in milliseconds, within its objective's.
pub const DEFAULT_MAX_WAIT_HEADER: &str = "x-rankgate-max-wait-ms";
/// The objective of a request that names none (or one not configured).
pub const DEFAULT_OBJECTIVE: &str = "default";
pub const DEFAULT_MAX_QUEUED: usize = 10_000;
pub const DEFAULT_MAX_QUEUED_BYTES: u64 = 256 * 1024 * 1024;
pub const DEFAULT_MAX_QUEUED_PER_TENANT: usize = 1_000;
pub const DEFAULT_MAX_QUEUED_BYTES_PER_TENANT: u64 = 64 * 1024 * 1024;
/// Tenants tracked at once: each costs a few hundred bytes, and a stranger can invent ids.
pub const DEFAULT_MAX_TENANTS: usize = 10_000;
/// Tenants named on `/metrics` (the busiest); the rest are summed as `other`.
pub const DEFAULT_TENANT_LABELS: usize = 10;
pub const DEFAULT_MAX_WAIT: Duration = secs(30);
const MAX_MAX_WAIT: Duration = secs(3_600);
/// vLLM starts queueing when its KV is full: a rank is saturated a little before, since the
/// telemetry is a poll old.
pub const DEFAULT_MAX_KV: f64 = 0.95;
/// A rank whose engine queues anything is saturated: what rankgate holds, it can still send to
/// whichever rank frees first, or overtake with more urgent work.
pub const DEFAULT_MAX_WAITING: u32 = 0;
/// Objectives at most: each is a priority band and a few counters.
pub const MAX_OBJECTIVES: usize = 64;
/// An objective's `reserve` at most (requests).
const MAX_RESERVE: u32 = 10_000;
/// A tenant id (a header value) is cut to this many bytes.
pub const MAX_TENANT_BYTES: usize = 128;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFlow {
    enabled: Option<bool>,
    tenant_header: Option<String>,
    objective_header: Option<String>,
    max_wait_header: Option<String>,
    default_objective: Option<String>,
    max_queued: Option<usize>,
    max_queued_bytes: Option<u64>,
    max_queued_per_tenant: Option<usize>,
    max_queued_bytes_per_tenant: Option<u64>,
    max_tenants: Option<usize>,
    tenant_labels: Option<usize>,
    max_wait: Option<HumanDuration>,
    max_waiting: Option<u32>,
    max_kv: Option<f64>,
    max_running: Option<u32>,
    #[serde(default)]
    objectives: Vec<RawObjective>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawObjective {
    name: String,
    #[serde(default)]
    priority: i32,
    max_wait: Option<HumanDuration>,
    weight: Option<f64>,
    engine_priority: Option<i64>,
    reserve: Option<u32>,
}

/// One objective: a priority band, with its own bound on the wait and its tenants' weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Objective {
    pub name: String,
    /// Higher goes first, strictly.
    pub priority: i32,
    pub max_wait: Duration,
    /// A tenant's share within the band is in proportion to the weight of the objective its
    /// requests name.
    pub weight: f64,
    /// Written into the request's body as `priority` (vLLM's `--scheduling-policy priority`
    /// orders its own queue by it: lower first).
    pub engine_priority: Option<i64>,
    /// Requests' room that objectives of lower priority leave free for this one (and those
    /// above it), among the ranks they may use: its requests find room at once, at the cost of
    /// that much of the fleet standing idle while only lower ones want it.
    pub reserve: u32,
}

/// When a rank is saturated: it takes nothing more from the queue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Saturation {
    /// The engine's waiting queue (with what was sent since the poll) past this.
    pub max_waiting: u32,
    /// KV usage with the work sent since the poll at or past this.
    pub max_kv: f64,
    /// Requests of this router in flight on the rank at or past this (the engine's
    /// `--max-num-seqs`, when it is the only client); `None`: no such limit.
    pub max_running: Option<u32>,
}

/// `[flow]`, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowConfig {
    pub enabled: bool,
    pub tenant_header: http::HeaderName,
    pub objective_header: http::HeaderName,
    pub max_wait_header: http::HeaderName,
    /// Sorted by priority, highest first; the default objective is among them.
    pub objectives: Vec<Objective>,
    /// Index into `objectives`.
    pub default_objective: usize,
    pub max_queued: usize,
    pub max_queued_bytes: u64,
    pub max_queued_per_tenant: usize,
    pub max_queued_bytes_per_tenant: u64,
    pub max_tenants: usize,
    pub tenant_labels: usize,
    pub saturation: Saturation,
}

impl Default for FlowConfig {
    fn default() -> FlowConfig {
        // The defaults cannot fail.
        flow(RawFlow::default()).unwrap_or_else(|_| unreachable!())
    }
}

impl FlowConfig {
    /// The objective called `name`.
    pub fn objective(&self, name: &str) -> Option<usize> {
        self.objectives.iter().position(|o| o.name == name)
    }
}

fn header(key: &str, v: Option<String>, default: &str) -> Result<http::HeaderName, ConfigError> {
    let v = v.unwrap_or_else(|| default.to_string());
    http::HeaderName::from_bytes(v.as_bytes())
        .map_err(|_| invalid(key, format!("{v:?} is not a valid HTTP header name")))
}

pub(super) fn flow(raw: RawFlow) -> Result<FlowConfig, ConfigError> {
    let max_wait = duration(
        "flow.max_wait",
        raw.max_wait,
        DEFAULT_MAX_WAIT,
        ms(1),
        MAX_MAX_WAIT,
    )?;
    let mut objectives = Vec::with_capacity(raw.objectives.len() + 1);
    for (i, o) in raw.objectives.into_iter().enumerate() {
        let key = |k: &str| format!("flow.objectives[{i}].{k}");
        if o.name.is_empty() || o.name.len() > MAX_TENANT_BYTES {
            return Err(invalid(
                key("name"),
                format!("must be 1 to {MAX_TENANT_BYTES} bytes"),
            ));
        }
        if objectives.iter().any(|x: &Objective| x.name == o.name) {
            return Err(invalid(key("name"), format!("{:?} is named twice", o.name)));
        }
        let weight = o.weight.unwrap_or(1.0);
        if !(weight.is_finite() && (0.001..=1000.0).contains(&weight)) {
            return Err(invalid(
                key("weight"),
                format!("{weight} is outside [0.001, 1000]"),
            ));
        }
        let reserve = o.reserve.unwrap_or(0);
        if reserve > MAX_RESERVE {
            return Err(invalid(
                key("reserve"),
                format!("{reserve} is more than {MAX_RESERVE} requests"),
            ));
        }
        objectives.push(Objective {
            reserve,
            max_wait: duration(&key("max_wait"), o.max_wait, max_wait, ms(1), MAX_MAX_WAIT)?,
            name: o.name,
            priority: o.priority,
            weight,
            engine_priority: o.engine_priority,
        });
    }
    if objectives.len() > MAX_OBJECTIVES {
        return Err(invalid(
            "flow.objectives",
            format!("{} objectives; at most {MAX_OBJECTIVES}", objectives.len()),
        ));
    }
    let default_name = raw.default_objective.as_deref();
    if let Some(name) = default_name {
        if !objectives.iter().any(|o| o.name == name) {
            return Err(invalid(
                "flow.default_objective",
                format!("{name:?} is not one of flow.objectives"),
            ));
        }
    } else if !objectives.iter().any(|o| o.name == DEFAULT_OBJECTIVE) {
        objectives.push(Objective {
            name: DEFAULT_OBJECTIVE.to_string(),
            priority: 0,
            max_wait,
            weight: 1.0,
            engine_priority: None,
            reserve: 0,
        });
    }
    // Highest priority first; equal ones keep the file's order.
    objectives.sort_by_key(|o| std::cmp::Reverse(o.priority));
    let default_name = default_name.unwrap_or(DEFAULT_OBJECTIVE);
    let default_objective = objectives
        .iter()
        .position(|o| o.name == default_name)
        .unwrap_or_default();
    let max_kv = raw.max_kv.unwrap_or(DEFAULT_MAX_KV);
    if !(max_kv.is_finite() && (0.05..=2.0).contains(&max_kv)) {
        return Err(invalid(
            "flow.max_kv",
            format!("{max_kv} is outside [0.05, 2.0] (a KV fraction)"),
        ));
    }
    if raw.max_running == Some(0) {
        return Err(invalid(
            "flow.max_running",
            "0 would never dispatch anything: leave it out for no limit",
        ));
    }
    let positive = |key: &str, v: Option<usize>, default: usize| match v.unwrap_or(default) {
        0 => Err(invalid(key, "must be at least 1")),
        n => Ok(n),
    };
    // A zero byte cap would refuse every request that waits: said here, not at the first one.
    let bytes = |key: &str, v: Option<u64>, default: u64| match v.unwrap_or(default) {
        0 => Err(invalid(key, "must be at least 1")),
        n => Ok(n),
    };
    let max_queued = positive("flow.max_queued", raw.max_queued, DEFAULT_MAX_QUEUED)?;
    Ok(FlowConfig {
        enabled: raw.enabled.unwrap_or(false),
        tenant_header: header(
            "flow.tenant_header",
            raw.tenant_header,
            DEFAULT_TENANT_HEADER,
        )?,
        objective_header: header(
            "flow.objective_header",
            raw.objective_header,
            DEFAULT_OBJECTIVE_HEADER,
        )?,
        max_wait_header: header(
            "flow.max_wait_header",
            raw.max_wait_header,
            DEFAULT_MAX_WAIT_HEADER,
        )?,
        objectives,
        default_objective,
        max_queued,
        max_queued_bytes: bytes(
            "flow.max_queued_bytes",
            raw.max_queued_bytes,
            DEFAULT_MAX_QUEUED_BYTES,
        )?,
        max_queued_per_tenant: positive(
            "flow.max_queued_per_tenant",
            raw.max_queued_per_tenant,
            DEFAULT_MAX_QUEUED_PER_TENANT,
        )?
        .min(max_queued),
        max_queued_bytes_per_tenant: bytes(
            "flow.max_queued_bytes_per_tenant",
            raw.max_queued_bytes_per_tenant,
            DEFAULT_MAX_QUEUED_BYTES_PER_TENANT,
        )?,
        max_tenants: positive("flow.max_tenants", raw.max_tenants, DEFAULT_MAX_TENANTS)?,
        tenant_labels: raw.tenant_labels.unwrap_or(DEFAULT_TENANT_LABELS).min(100),
        saturation: Saturation {
            max_waiting: raw.max_waiting.unwrap_or(DEFAULT_MAX_WAITING),
            max_kv,
            max_running: raw.max_running,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<FlowConfig, ConfigError> {
        flow(toml::from_str(s).map_err(|e| invalid("flow", e.to_string()))?)
    }

    #[test]
    fn defaults_are_off_with_one_default_objective() {
        let f = FlowConfig::default();
        assert!(!f.enabled);
        assert_eq!(f.objectives.len(), 1);
        assert_eq!(f.objectives[f.default_objective].name, DEFAULT_OBJECTIVE);
        assert_eq!(f.tenant_header.as_str(), DEFAULT_TENANT_HEADER);
        assert_eq!(f.saturation.max_running, None);
    }

    #[test]
    fn objectives_sort_by_priority_and_inherit_the_wait() {
        let f = parse(
            r#"
            enabled = true
            max_wait = "10s"
            default_objective = "standard"
            [[objectives]]
            name = "batch"
            priority = -10
            weight = 0.5
            [[objectives]]
            name = "premium"
            priority = 100
            max_wait = "2s"
            engine_priority = -5
            reserve = 2
            [[objectives]]
            name = "standard"
            "#,
        )
        .unwrap();
        let names: Vec<_> = f.objectives.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["premium", "standard", "batch"]);
        assert_eq!(f.objectives[f.default_objective].name, "standard");
        assert_eq!(f.objectives[0].max_wait, Duration::from_secs(2));
        assert_eq!(f.objectives[2].max_wait, Duration::from_secs(10));
        assert_eq!(f.objectives[0].engine_priority, Some(-5));
        assert_eq!((f.objectives[0].reserve, f.objectives[1].reserve), (2, 0));
    }

    #[test]
    fn bad_values_name_their_key() {
        for (toml, key) in [
            ("default_objective = \"nope\"", "flow.default_objective"),
            ("max_kv = 0.0", "flow.max_kv"),
            ("max_running = 0", "flow.max_running"),
            ("max_queued = 0", "flow.max_queued"),
            ("max_queued_bytes = 0", "flow.max_queued_bytes"),
            (
                "max_queued_bytes_per_tenant = 0",
                "flow.max_queued_bytes_per_tenant",
            ),
            ("tenant_header = \"a b\"", "flow.tenant_header"),
            ("[[objectives]]\nname = \"\"", "flow.objectives[0].name"),
            (
                "[[objectives]]\nname = \"a\"\nweight = -1.0",
                "flow.objectives[0].weight",
            ),
            (
                "[[objectives]]\nname = \"a\"\n[[objectives]]\nname = \"a\"",
                "flow.objectives[1].name",
            ),
        ] {
            let err = parse(toml).unwrap_err().to_string();
            assert!(err.contains(key), "{toml}: {err}");
        }
        assert!(parse("nope = 1").is_err());
    }
}
