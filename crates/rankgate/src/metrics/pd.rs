//! Disaggregated requests (prefill on one rank, decode on another): how each ended, the failures
//! of each leg by kind, the prefill leg's time and the decode leg's time to first byte. Counted
//! in atomics, encoded at scrape time; every label set is there from the start, at 0, so a
//! rate over it never starts from nothing.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;

use super::histogram::Histogram;

/// The leg of a disaggregated request that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PdLeg {
    Prefill = 0,
    Decode = 1,
}

impl PdLeg {
    pub const ALL: [PdLeg; 2] = [PdLeg::Prefill, PdLeg::Decode];

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
}

impl PdFailure {
    pub const ALL: [PdFailure; 7] = [
        PdFailure::NoRank,
        PdFailure::Transport,
        PdFailure::Timeout,
        PdFailure::Status,
        PdFailure::NoParams,
        PdFailure::Unreadable,
        PdFailure::Other,
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
        }
    }
}

/// The counters, one set for the router.
#[derive(Debug, Default)]
pub struct PdCounts {
    /// Disaggregated requests whose decode leg answered (any status: the engine's).
    decoded: AtomicU64,
    /// Failures by leg and kind.
    failures: [[AtomicU64; PdFailure::ALL.len()]; 2],
    /// Requests whose client left before the decode leg began (no decode is started for them).
    abandoned: AtomicU64,
    /// From the prefill leg's start to its KV transfer parameters read.
    prefill: Histogram,
    /// From the decode leg's start to its first byte reaching the client.
    decode_first_byte: Histogram,
}

impl PdCounts {
    pub fn decoded(&self) {
        self.decoded.fetch_add(1, Relaxed);
    }

    pub fn failed(&self, leg: PdLeg, kind: PdFailure) {
        self.failures[leg as usize][kind as usize].fetch_add(1, Relaxed);
    }

    pub fn abandoned(&self) {
        self.abandoned.fetch_add(1, Relaxed);
    }

    pub fn prefill_took(&self, d: Duration) {
        self.prefill.observe(d);
    }

    pub fn decode_first_byte(&self, d: Duration) {
        self.decode_first_byte.observe(d);
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
            "Disaggregated requests whose decode leg answered (prefill on one rank, then \
             decode with its KV on another)",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(c.decoded.load(Relaxed)).encode(m)?;
        let m = enc.encode_descriptor(
            "rankgate_pd_abandoned",
            "Disaggregated requests whose client left during the prefill leg: no decode leg \
             was started",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(c.abandoned.load(Relaxed)).encode(m)?;
        let mut m = enc.encode_descriptor(
            "rankgate_pd_failures",
            "Failed legs of disaggregated requests, by leg (prefill, decode) and kind: no_rank, \
             transport, timeout, status (an error answer after retries), no_params (a prefill \
             answer without kv_transfer_params), unreadable (a prefill answer that could not \
             be read), other",
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
