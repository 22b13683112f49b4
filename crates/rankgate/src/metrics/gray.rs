//! Gray failures on `/metrics`: requests clients abandoned, per rank and reason; requests that
//! waited past the fleet's first-byte bound (hung), per rank; each rank's consecutive failures;
//! and the bound itself ([`crate::first_byte`]). Read from the current snapshot at scrape time.

use std::fmt;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::first_byte::Bound;
use crate::table::Table;

/// The `reason` label of `rankgate_requests_abandoned_total`, in the order of
/// `WorkerCounters::abandoned`.
pub const ABANDONED: [&str; 2] = ["before_first_byte", "mid_stream"];

#[derive(Debug)]
pub(super) struct Gray {
    pub table: Arc<Table>,
    pub bound: Arc<Bound>,
}

impl Collector for Gray {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let snap = self.table.snapshot.load();
        let workers = &snap.fleet.workers;
        let mut m = enc.encode_descriptor(
            "rankgate_requests_abandoned",
            "Requests whose client left before their answer ended, by rank and reason: \
             before_first_byte (no response headers from the engine yet), mid_stream.",
            None,
            MetricType::Counter,
        )?;
        for w in workers {
            for (reason, n) in ABANDONED.iter().zip(&w.counters.abandoned) {
                let labels = [("worker", &*w.id_text), ("reason", reason)];
                ConstCounter::new(n.load(Relaxed)).encode(m.encode_family(&labels)?)?;
            }
        }
        let mut m = enc.encode_descriptor(
            "rankgate_requests_hung",
            "Requests on the rank that waited for their first byte past the fleet's bound \
             (rankgate_first_byte_hung_after_seconds), or whose client left after waiting past \
             the factor times the fleet's p99: each a failure of the rank (routing.hung_factor).",
            None,
            MetricType::Counter,
        )?;
        for w in workers {
            let labels = [("worker", &*w.id_text)];
            ConstCounter::new(w.counters.hung.load(Relaxed)).encode(m.encode_family(&labels)?)?;
        }
        let mut m = enc.encode_descriptor(
            "rankgate_rank_consecutive_failures",
            "The rank's failures since its last success (5xx, timeouts, transport errors, hung \
             requests); routing.eject_after of them eject it.",
            None,
            MetricType::Gauge,
        )?;
        for w in workers {
            let labels = [("worker", &*w.id_text)];
            let n = w.live.outlier.failures() as i64;
            ConstGauge::new(n).encode(m.encode_family(&labels)?)?;
        }
        let secs = |d: Option<std::time::Duration>| d.map_or(0.0, |d| d.as_secs_f64());
        for (name, help, v) in [
            (
                "rankgate_first_byte_p99_seconds",
                "The fleet's p99 time to first byte over the last 30 s, every model together; 0 \
                 while too few requests got one to judge by.",
                secs(self.bound.typical()),
            ),
            (
                "rankgate_first_byte_hung_after_seconds",
                "How long a request may wait for its first byte before it counts as hung: \
                 routing.hung_factor times the p99, not below routing.hung_floor; 0: nothing is \
                 judged now.",
                secs(self.bound.stall()),
            ),
        ] {
            let m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(v).encode(m)?;
        }
        Ok(())
    }
}
