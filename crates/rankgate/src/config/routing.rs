//! The `[routing]` table: the policy, and how requests are retried, ejected and kept near
//! their prompt's prefix.

use std::time::Duration;

use serde::Deserialize;

use super::duration::{duration, ms, HumanDuration};
use super::error::{invalid, ConfigError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    #[default]
    LeastKv,
    RoundRobin,
    Random,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::LeastKv => "least_kv",
            Policy::RoundRobin => "round_robin",
            Policy::Random => "random",
        }
    }
}

/// What `least_kv` does when no rank has usable telemetry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum NoTelemetry {
    #[default]
    LeastInFlight,
    Reject,
}

/// KV fraction one request is assumed to hold until the fleet's own numbers say otherwise.
pub const DEFAULT_REQUEST_KV_ESTIMATE: f64 = 0.02;
pub const DEFAULT_RETRY_AFTER_SECS: u32 = 1;
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
pub const MAX_MAX_ATTEMPTS: u32 = 10;
pub const DEFAULT_RETRY_BUFFER_BYTES: usize = 4 * 1024 * 1024;
/// Share of requests that may be retries, over the budget's window.
pub const DEFAULT_RETRY_BUDGET: f64 = 0.2;
/// Engine statuses `routing.retry_on` may name: 500, and the three that are retried anyway.
/// Any other 5xx (501 Not Implemented, 505) would be the same answer on every engine, and a
/// 4xx is the client's own.
pub const RETRY_ON_STATUSES: [u16; 4] = [500, 502, 503, 504];
pub const DEFAULT_EJECT_AFTER: u32 = 5;
/// About one request's KV: ranks closer than that are the same load to a router that cannot see
/// the other routers' requests.
pub const DEFAULT_TIE_MARGIN: f64 = 0.02;
/// Affinity may choose a rank this far above the best: about four requests of a multi-turn chat
/// on a 32 K-token rank. At 0.1 the rank holding a conversation fell out of reach about one turn
/// in five in the multi-turn scenario (docs/routing-quality.md); `affinity_max_kv` still keeps
/// any full rank out.
pub const DEFAULT_AFFINITY_MARGIN: f64 = 0.2;
/// ...and never one whose projected KV is at or above this.
pub const DEFAULT_AFFINITY_MAX_KV: f64 = 0.85;
pub const DEFAULT_EJECT_FOR: Duration = Duration::from_secs(10);
/// A request is hung once it waited for its first byte this many times the fleet's recent p99
/// time to first byte (`crate::first_byte`): far enough above it that a rank a little slower
/// than its peers, or a long answer that is not streamed, is not mistaken for one.
pub const DEFAULT_HUNG_FACTOR: f64 = 4.0;
/// ...and never before this, however fast the fleet.
pub const DEFAULT_HUNG_FLOOR: Duration = Duration::from_secs(1);
/// Longest an ejection lasts however often a rank is ejected in a row.
pub const MAX_EJECT_FOR: Duration = Duration::from_secs(5 * 60);

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRouting {
    policy: Option<Policy>,
    no_telemetry: Option<NoTelemetry>,
    request_kv_estimate: Option<f64>,
    retry_after_secs: Option<u32>,
    max_attempts: Option<u32>,
    retry_buffer_bytes: Option<usize>,
    retry_budget: Option<f64>,
    retry_on: Option<Vec<u16>>,
    eject_after: Option<u32>,
    eject_for: Option<HumanDuration>,
    hung_factor: Option<f64>,
    hung_floor: Option<HumanDuration>,
    tie_margin: Option<f64>,
    prefix_affinity: Option<bool>,
    adapter_affinity: Option<bool>,
    affinity_margin: Option<f64>,
    affinity_max_kv: Option<f64>,
    kv_events: Option<bool>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RoutingConfig {
    pub policy: Policy,
    pub no_telemetry: NoTelemetry,
    pub request_kv_estimate: f64,
    pub retry_after_secs: u32,
    /// Attempts per request, the first included, when upstreams fail before the first byte.
    pub max_attempts: u32,
    /// Bodies up to this size are kept for a replay; larger ones stream and are not retried.
    pub retry_buffer_bytes: usize,
    /// Retries allowed as a share of requests (over a 10 s window, plus a small floor).
    pub retry_budget: f64,
    /// Engine statuses retried besides 502, 503 and 504 (only 500 may be added; none by
    /// default: an engine's 500 may come from the request itself).
    pub retry_on: Vec<u16>,
    /// Consecutive failures that eject a rank; 0 never ejects.
    pub eject_after: u32,
    /// First ejection's length; it doubles with each ejection in a row, up to [`MAX_EJECT_FOR`].
    pub eject_for: Duration,
    /// A request still without its first byte after this many times the fleet's recent p99
    /// time to first byte is a failure of its rank (hung); 0 judges none.
    pub hung_factor: f64,
    /// ...but never before this.
    pub hung_floor: Duration,
    /// `least_kv` picks at random among ranks scoring within this of the best, so that several
    /// rankgates seeing the same telemetry do not all send to the one idlest rank.
    pub tie_margin: f64,
    /// Prefer, among ranks load allows, the one that was sent the longest prefix of the prompt.
    pub prefix_affinity: bool,
    /// A request for a LoRA adapter prefers, among ranks load allows (`affinity_margin`), one
    /// running it, then one with a free adapter slot.
    pub adapter_affinity: bool,
    /// Ranks scoring within this of the best are the ones affinity may choose among.
    pub affinity_margin: f64,
    /// ...and only those scoring below this.
    pub affinity_max_kv: f64,
    /// Affinity follows the engines' own KV-cache events where a rank publishes them (its
    /// cached blocks, exactly), and rankgate's record of what it sent elsewhere.
    pub kv_events: bool,
}

/// Validates `[routing]`; replay buffers never exceed `max_body_bytes`.
pub(super) fn routing(
    raw: RawRouting,
    max_body_bytes: usize,
) -> Result<RoutingConfig, ConfigError> {
    let routing = RoutingConfig {
        policy: raw.policy.unwrap_or_default(),
        no_telemetry: raw.no_telemetry.unwrap_or_default(),
        request_kv_estimate: raw
            .request_kv_estimate
            .unwrap_or(DEFAULT_REQUEST_KV_ESTIMATE),
        retry_after_secs: raw.retry_after_secs.unwrap_or(DEFAULT_RETRY_AFTER_SECS),
        max_attempts: raw.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS),
        retry_buffer_bytes: raw
            .retry_buffer_bytes
            .unwrap_or(DEFAULT_RETRY_BUFFER_BYTES)
            .min(max_body_bytes),
        retry_budget: raw.retry_budget.unwrap_or(DEFAULT_RETRY_BUDGET),
        retry_on: raw.retry_on.unwrap_or_default(),
        eject_after: raw.eject_after.unwrap_or(DEFAULT_EJECT_AFTER),
        eject_for: duration(
            "routing.eject_for",
            raw.eject_for,
            DEFAULT_EJECT_FOR,
            ms(100),
            MAX_EJECT_FOR,
        )?,
        hung_factor: raw.hung_factor.unwrap_or(DEFAULT_HUNG_FACTOR),
        hung_floor: duration(
            "routing.hung_floor",
            raw.hung_floor,
            DEFAULT_HUNG_FLOOR,
            ms(100),
            MAX_EJECT_FOR,
        )?,
        tie_margin: raw.tie_margin.unwrap_or(DEFAULT_TIE_MARGIN),
        prefix_affinity: raw.prefix_affinity.unwrap_or(false),
        adapter_affinity: raw.adapter_affinity.unwrap_or(true),
        affinity_margin: raw.affinity_margin.unwrap_or(DEFAULT_AFFINITY_MARGIN),
        affinity_max_kv: raw.affinity_max_kv.unwrap_or(DEFAULT_AFFINITY_MAX_KV),
        kv_events: raw.kv_events.unwrap_or(false),
    };
    for (key, v, max) in [
        ("routing.hung_factor", routing.hung_factor, 1000.0),
        ("routing.tie_margin", routing.tie_margin, 0.5),
        ("routing.affinity_margin", routing.affinity_margin, 1.0),
    ] {
        if !(0.0..=max).contains(&v) {
            return Err(invalid(key, format!("{v} must be in [0, {max}]")));
        }
    }
    if routing.hung_factor > 0.0 && routing.hung_factor < 1.0 {
        return Err(invalid(
            "routing.hung_factor",
            format!(
                "{} must be 0 (judge no request hung) or at least 1 (below, the fleet's own typical requests would count as hung)",
                routing.hung_factor
            ),
        ));
    }
    let max_kv = routing.affinity_max_kv;
    if !(max_kv > 0.0 && max_kv <= 1.0) {
        return Err(invalid(
            "routing.affinity_max_kv",
            format!("{max_kv} must be in (0, 1] (0 would leave affinity no rank to choose)"),
        ));
    }
    if routing.prefix_affinity && routing.policy != Policy::LeastKv {
        return Err(invalid(
            "routing.prefix_affinity",
            format!(
                "works with policy = \"least_kv\" only (it chooses among the ranks load allows); policy is {:?}",
                routing.policy.as_str()
            ),
        ));
    }
    if routing.kv_events && !routing.prefix_affinity {
        return Err(invalid(
            "routing.kv_events",
            "refines prefix affinity (which rank holds the prompt's prefix): set routing.prefix_affinity = true too",
        ));
    }
    if !(1..=MAX_MAX_ATTEMPTS).contains(&routing.max_attempts) {
        return Err(invalid(
            "routing.max_attempts",
            format!(
                "{} must be between 1 (no retries) and {MAX_MAX_ATTEMPTS}",
                routing.max_attempts
            ),
        ));
    }
    if !(0.0..=1.0).contains(&routing.retry_budget) {
        return Err(invalid(
            "routing.retry_budget",
            format!(
                "{} must be a share of requests in [0, 1]",
                routing.retry_budget
            ),
        ));
    }
    if let Some(s) = (routing.retry_on.iter()).find(|s| !RETRY_ON_STATUSES.contains(s)) {
        return Err(invalid(
            "routing.retry_on",
            format!("{s} cannot be retried: list 500 (502, 503 and 504 are retried anyway); another 5xx would be the same on every engine, and a 4xx is the client's own"),
        ));
    }
    let est = routing.request_kv_estimate;
    if !(est > 0.0 && est <= 1.0) {
        return Err(invalid(
            "routing.request_kv_estimate",
            format!("{est} must be in (0, 1]"),
        ));
    }
    Ok(routing)
}
