//! `rankgate_kv_publishers_refused_total`: the KV-event publishers rankgate's bound endpoints
//! refused ([`crate::kv::listen`]), read from the table's counters at scrape time.

use std::fmt;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;

use crate::table::Table;

#[derive(Debug)]
pub(super) struct KvPublishers {
    pub table: Arc<Table>,
}

impl Collector for KvPublishers {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let r = &self.table.kv_refused;
        let mut m = enc.encode_descriptor(
            "rankgate_kv_publishers_refused",
            "KV-event publishers refused on an endpoint rankgate binds (routing.kv_events), by \
             reason: stranger (not an address of an engine publishing there), full, duplicate \
             (its rank already has a publisher), oversized, slow (a message not finished in \
             time).",
            None,
            MetricType::Counter,
        )?;
        for (reason, c) in [
            ("stranger", &r.stranger),
            ("full", &r.full),
            ("duplicate", &r.duplicate),
            ("oversized", &r.oversized),
            ("slow", &r.slow),
        ] {
            ConstCounter::new(c.load(Relaxed)).encode(m.encode_family(&[("reason", reason)])?)?;
        }
        Ok(())
    }
}
