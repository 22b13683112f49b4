//! Disaggregated requests (prefill on one rank, decode on another): how each ended, the failures
//! of each leg by kind, the prefill leg's time and the decode leg's time to first byte. Counted
//! in atomics, encoded at scrape time; every label set is there from the start, at 0, so a
//! rate over it never starts from nothing.

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;

use super::histogram::Histogram;
use crate::config::Flavor;

/// The leg of a disaggregated request that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdLeg {
    Prefill = 0,
    Decode = 1,
}

impl PdLeg {
    pub const ALL: [PdLeg; 2] = [PdLeg::Prefill, PdLeg::Decode];

    /// The leg a server of `role` takes; `None` for a whole engine.
    pub fn of(role: crate::config::Role) -> Option<PdLeg> {
        match role {
            crate::config::Role::Prefill => Some(PdLeg::Prefill),
            crate::config::Role::Decode => Some(PdLeg::Decode),
            crate::config::Role::Both => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PdLeg::Prefill => "prefill",
            PdLeg::Decode => "decode",
        }
    }
}

/// How a leg failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdFailure {
    /// No rank of its side could take it (none routable, or the side has no server).
    NoRank = 0,
    /// The connection failed or broke before the answer.
    Transport = 1,
    /// No answer within `server.response_timeout`.
    Timeout = 2,
    /// The engine answered with an error status (after any retries).
    Status = 3,
    /// The prefill server answered 200 without `kv_transfer_params`.
    NoParams = 4,
    /// The prefill server's answer could not be read (not JSON, too large, cut).
    Unreadable = 5,
    /// Anything else (the client's own body, rankgate's limits).
    Other = 6,
    /// No leg could be sent: the model's prefill and decode servers cannot pair (their flavors
    /// differ, or a side is missing). Counted on the prefill leg, the one never started.
    Unpaired = 7,
    /// The prefill server's `kv_transfer_params` were refused (a foreign host, a bad port, a
    /// member of the wrong type or size): no decode saw them.
    BadParams = 8,
}

impl PdFailure {
    pub const ALL: [PdFailure; 9] = [
        PdFailure::NoRank,
        PdFailure::Transport,
        PdFailure::Timeout,
        PdFailure::Status,
        PdFailure::NoParams,
        PdFailure::Unreadable,
        PdFailure::Other,
        PdFailure::Unpaired,
        PdFailure::BadParams,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PdFailure::NoRank => "no_rank",
            PdFailure::Transport => "transport",
            PdFailure::Timeout => "timeout",
            PdFailure::Status => "status",
            PdFailure::NoParams => "no_params",
            PdFailure::Unreadable => "unreadable",
            PdFailure::Other => "other",
            PdFailure::Unpaired => "unpaired",
            PdFailure::BadParams => "bad_params",
        }
    }
}

/// Failed legs in a row on one rank before its side is shown failing in `/workers` (and its
/// engine logged at WARN, once): enough that a passing fault is not mistaken for a config
/// that fails every request, few enough that an operator hears of one within a few requests.
pub const PD_FAILING_AFTER: u32 = 3;

/// One rank's part in disaggregated requests as its last legs went: how many failed in a row,
/// and how the last one failed. Written only when a leg ends (never on a whole request's
/// path), read by `/workers`.
#[derive(Debug, Default)]
pub struct RankPdHealth {
    streak: AtomicU32,
    /// The last failure's kind, plus one (0: none yet).
    last: AtomicU8,
}

impl RankPdHealth {
    /// A leg that ended well: the streak is over.
    pub fn ok(&self) {
        if self.streak.load(Relaxed) != 0 {
            self.streak.store(0, Relaxed);
        }
    }

    /// A leg that failed with `kind`: the failures in a row now.
    pub fn failed(&self, kind: PdFailure) -> u32 {
        self.last.store(kind as u8 + 1, Relaxed);
        self.streak.fetch_add(1, Relaxed).saturating_add(1)
    }

    /// `Some(kind)` while the rank's last [`PD_FAILING_AFTER`] legs or more all failed.
    pub fn failing(&self) -> Option<PdFailure> {
        if self.streak.load(Relaxed) < PD_FAILING_AFTER {
            return None;
        }
        let last = self.last.load(Relaxed).checked_sub(1)?;
        PdFailure::ALL.get(usize::from(last)).copied()
    }

    /// Failed legs in a row.
    pub fn streak(&self) -> u32 {
        self.streak.load(Relaxed)
    }

    /// `/workers`' `pd` of a rank taking `leg`s of an engine of `flavor`: `failing` (how its
    /// last legs failed, and what most likely causes it) once its last [`PD_FAILING_AFTER`]
    /// legs all failed, else `ok`.
    pub fn shown(&self, leg: PdLeg, flavor: Flavor) -> serde_json::Value {
        let streak = self.streak();
        match self.failing() {
            Some(kind) => serde_json::json!({
                "state": "failing",
                "kind": kind.as_str(),
                "failed_in_a_row": streak,
                "likely_cause": likely_cause(leg, kind, flavor),
            }),
            None => serde_json::json!({"state": "ok", "failed_in_a_row": streak}),
        }
    }
}

/// What most likely makes a side fail every leg this way.
pub fn likely_cause(leg: PdLeg, kind: PdFailure, flavor: Flavor) -> &'static str {
    match (leg, kind, flavor) {
        (PdLeg::Prefill, PdFailure::NoParams, _) => {
            "the prefill server answers without kv_transfer_params: it was started without a KV connector (vLLM: --kv-transfer-config with kv_connector NixlConnector and kv_role kv_producer), or it is no prefill server (check its role)"
        }
        (PdLeg::Decode, PdFailure::Status, Flavor::Sglang) => {
            "the decode server fails every request: the prefill server's bootstrap_port is likely wrong (it must be the prefill's --disaggregation-bootstrap-port), or the decode cannot reach that port"
        }
        (PdLeg::Decode, PdFailure::Status, _) => {
            "the decode server fails every request: its KV pull likely fails (the prefill's NIXL side channel unreachable: VLLM_NIXL_SIDE_CHANNEL_HOST/PORT, or the decode started without kv_role kv_consumer)"
        }
        (PdLeg::Prefill, PdFailure::Status, Flavor::Sglang) => {
            "the prefill server fails every request: its decode never came for the room (the decode's bootstrap address or port wrong?), or it was started without --disaggregation-mode prefill"
        }
        (PdLeg::Prefill, PdFailure::Status, _) => {
            "the prefill server fails every request: check that it was started with a KV connector as kv_producer and that it serves the model"
        }
        (_, PdFailure::Transport | PdFailure::Timeout, _) => {
            "the server does not answer (down, unreachable, or too slow for server.response_timeout)"
        }
        (_, PdFailure::Unreadable, _) => {
            "the prefill server's answers cannot be read: is it a vLLM prefill server?"
        }
        (_, PdFailure::BadParams, _) => {
            "the prefill server's kv_transfer_params are refused: its remote_host is not its url's host (list the address its KV side channel reports, VLLM_NIXL_SIDE_CHANNEL_HOST, in engines[].kv_hosts), or it answers parameters out of type or size (is it what it claims?)"
        }
        (_, PdFailure::NoRank, _) => "none of the side's ranks can take a leg (unavailable or ejected)",
        (_, PdFailure::Unpaired, _) => "the model's prefill and decode servers cannot pair",
        _ => "see the engine's log",
    }
}

/// Where a disaggregated request was when its client left (`rankgate_pd_abandoned`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdStage {
    /// Before the prefill's answer: no blocks are lent yet (the prefill is cancelled).
    Prefill,
    /// After the prefill's answer, before the decode leg was handed on: the prefill server
    /// holds the blocks and no decode will pull them (see docs/disaggregation.md).
    Between,
    /// The decode leg, before its answer: its connection is closed, which aborts it.
    Decode,
}

impl PdStage {
    pub const ALL: [PdStage; 3] = [PdStage::Prefill, PdStage::Between, PdStage::Decode];

    pub fn as_str(self) -> &'static str {
        match self {
            PdStage::Prefill => "prefill",
            PdStage::Between => "between",
            PdStage::Decode => "decode",
        }
    }
}

/// The counters, one set for the router.
#[derive(Debug, Default)]
pub struct PdCounts {
    /// Disaggregated requests whose decode leg answered with a success status.
    decoded: AtomicU64,
    /// Failures by leg and kind.
    failures: [[AtomicU64; PdFailure::ALL.len()]; 2],
    /// Requests whose client left before their answer, by where they were ([`PdStage`]).
    abandoned: [AtomicU64; 3],
    /// Releases of the blocks of requests abandoned between the legs: sent and read (0), or
    /// failed (1).
    released: [AtomicU64; 2],
    /// From the prefill leg's start to its KV transfer parameters read.
    prefill: Histogram,
    /// From the decode leg's start to its first byte reaching the client.
    decode_first_byte: Histogram,
    /// What was logged at WARN already (an engine's failing side, an unpairable model): each
    /// once for the router's life. Touched only when a leg fails.
    warned: Mutex<HashSet<String>>,
}

impl PdCounts {
    pub fn decoded(&self) {
        self.decoded.fetch_add(1, Relaxed);
    }

    pub fn failed(&self, leg: PdLeg, kind: PdFailure) {
        self.failures[leg as usize][kind as usize].fetch_add(1, Relaxed);
    }

    pub fn abandoned(&self, stage: PdStage) {
        self.abandoned[stage as usize].fetch_add(1, Relaxed);
    }

    /// A release of an abandoned request's blocks ended: read by a decode, or not.
    pub fn released(&self, ok: bool) {
        self.released[usize::from(!ok)].fetch_add(1, Relaxed);
    }

    /// Requests abandoned at `stage` so far.
    pub fn abandoned_at(&self, stage: PdStage) -> u64 {
        self.abandoned[stage as usize].load(Relaxed)
    }

    pub fn prefill_took(&self, d: Duration) {
        self.prefill.observe(d);
    }

    pub fn decode_first_byte(&self, d: Duration) {
        self.decode_first_byte.observe(d);
    }

    /// Whether `what` is logged for the first time (then remembered, so never again).
    pub fn first_warning(&self, what: &str) -> bool {
        let mut warned = self.warned.lock().unwrap_or_else(PoisonError::into_inner);
        !warned.contains(what) && warned.insert(what.to_string())
    }

    /// Decoded requests so far.
    pub fn decoded_count(&self) -> u64 {
        self.decoded.load(Relaxed)
    }

    /// Failures of `leg` of kind `kind` so far.
    pub fn failures(&self, leg: PdLeg, kind: PdFailure) -> u64 {
        self.failures[leg as usize][kind as usize].load(Relaxed)
    }
}

/// Encodes [`PdCounts`].
#[derive(Debug)]
pub(super) struct Pd(pub Arc<PdCounts>);

impl Collector for Pd {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let c = &self.0;
        let m = enc.encode_descriptor(
            "rankgate_pd_decoded",
            "Disaggregated requests whose decode leg answered with a success status (prefill \
             on one rank, then decode with its KV on another); failed legs are in \
             rankgate_pd_failures",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(c.decoded.load(Relaxed)).encode(m)?;
        let mut m = enc.encode_descriptor(
            "rankgate_pd_abandoned",
            "Disaggregated requests whose client left before their answer, by stage: prefill \
             (no decode leg is started), between (after the prefill's answer, before the \
             decode leg: the prefill server holds the blocks until its lease), decode (the \
             decode leg is cancelled)",
            None,
            MetricType::Counter,
        )?;
        for stage in PdStage::ALL {
            ConstCounter::new(c.abandoned_at(stage))
                .encode(m.encode_family(&[("stage", stage.as_str())])?)?;
        }
        let mut m = enc.encode_descriptor(
            "rankgate_pd_released",
            "Releases of the KV blocks a vLLM prefill server lent for a request whose client \
             left between the legs (a decode of one token sent for them, which frees them; \
             vLLM has no other way but its lease), by outcome: read, failed",
            None,
            MetricType::Counter,
        )?;
        for (i, outcome) in ["read", "failed"].into_iter().enumerate() {
            ConstCounter::new(c.released[i].load(Relaxed))
                .encode(m.encode_family(&[("outcome", outcome)])?)?;
        }
        let mut m = enc.encode_descriptor(
            "rankgate_pd_failures",
            "Failed legs of disaggregated requests, by leg (prefill, decode) and kind: no_rank, \
             transport, timeout, status (an error answer after retries), no_params (a prefill \
             answer without kv_transfer_params), unreadable (a prefill answer that could not \
             be read), unpaired (the model's prefill and decode servers cannot pair: no leg \
             was sent), bad_params (a prefill's kv_transfer_params refused: a foreign \
             remote_host, a bad port, a member of the wrong type or size), other",
            None,
            MetricType::Counter,
        )?;
        for leg in PdLeg::ALL {
            for kind in PdFailure::ALL {
                ConstCounter::new(c.failures(leg, kind))
                    .encode(m.encode_family(&[("leg", leg.as_str()), ("kind", kind.as_str())])?)?;
            }
        }
        let m = enc.encode_descriptor(
            "rankgate_pd_prefill_seconds",
            "Prefill legs of disaggregated requests, from the leg's start (retries included) \
             to the prefill server's KV transfer parameters read",
            None,
            MetricType::Histogram,
        )?;
        c.prefill.encode(m)?;
        let m = enc.encode_descriptor(
            "rankgate_pd_decode_first_byte_seconds",
            "Decode legs of disaggregated requests, from the leg's start to its first byte \
             reaching the client (the decode server's time to first token, KV transfer \
             included)",
            None,
            MetricType::Histogram,
        )?;
        c.decode_first_byte.encode(m)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_broken_config_has_its_likely_cause() {
        let no_connector = likely_cause(PdLeg::Prefill, PdFailure::NoParams, Flavor::Vllm);
        assert!(no_connector.contains("KV connector"), "{no_connector}");
        let port = likely_cause(PdLeg::Decode, PdFailure::Status, Flavor::Sglang);
        assert!(port.contains("bootstrap_port"), "{port}");
    }

    #[test]
    fn a_rank_fails_after_a_run_of_failed_legs_and_recovers_with_one_good_one() {
        let h = RankPdHealth::default();
        for n in 1..PD_FAILING_AFTER {
            assert_eq!(h.failed(PdFailure::NoParams), n);
            assert_eq!(h.failing(), None);
        }
        h.failed(PdFailure::NoParams);
        assert_eq!(h.failing(), Some(PdFailure::NoParams));
        h.ok();
        assert_eq!((h.failing(), h.streak()), (None, 0));
    }
}
