//! Flow control seen from outside: its `/metrics` series (a collector reading the counters at
//! scrape time) and the admin listener's `/flows` page. Objectives are a fixed, configured set;
//! tenants are a stranger's to invent, so only the busiest `flow.tenant_labels` are named and
//! the rest are summed as `other`.

use std::fmt;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use serde_json::{json, Value};

use super::control::Flows;
use super::refusal::REASONS;
use super::stats::busiest;

#[derive(Debug)]
struct View(Arc<Flows>);

/// The collector `/metrics` registers for `flows`.
pub fn collector(flows: &Arc<Flows>) -> Box<dyn Collector> {
    Box::new(View(flows.clone()))
}

impl Collector for View {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let flows = &self.0;
        let names = || flows.cfg.objectives.iter().map(|o| o.name.as_str());
        let each = flows.stats.iter().zip(names());
        let mut m = enc.encode_descriptor(
            "rankgate_flow_queue_requests",
            "Requests waiting in rankgate for room on a rank, by objective",
            None,
            MetricType::Gauge,
        )?;
        for (s, name) in each.clone() {
            let n = s.queued.load(Relaxed).max(0);
            ConstGauge::new(n).encode(m.encode_family(&[("objective", name)])?)?;
        }
        let mut m = enc.encode_descriptor(
            "rankgate_flow_dispatched",
            "Requests flow control sent on, by objective and how: at once (the fleet had room \
             and nothing waited) or after waiting",
            None,
            MetricType::Counter,
        )?;
        for (s, name) in each.clone() {
            for (how, n) in [("direct", &s.direct), ("queued", &s.dispatched)] {
                let labels = [("objective", name), ("how", how)];
                ConstCounter::new(n.load(Relaxed)).encode(m.encode_family(&labels)?)?;
            }
        }
        let mut m = enc.encode_descriptor(
            "rankgate_flow_rejected",
            "Requests flow control answered itself (503) or lost to their client, by objective \
             and reason: queue_full, tenant_queue_full, deadline, shutting_down, client_gone",
            None,
            MetricType::Counter,
        )?;
        for (s, name) in each.clone() {
            for (reason, n) in REASONS.iter().zip(&s.rejected) {
                let labels = [("objective", name), ("reason", reason)];
                ConstCounter::new(n.load(Relaxed)).encode(m.encode_family(&labels)?)?;
            }
        }
        let m = enc.encode_descriptor(
            "rankgate_flow_wait_seconds",
            "How long requests waited in rankgate's queue (those that waited), by objective",
            None,
            MetricType::Histogram,
        )?;
        let mut m = m;
        for (s, name) in each {
            s.wait.encode(m.encode_family(&[("objective", name)])?)?;
        }
        let (top, other) = busiest(&flows.tenants(), flows.cfg.tenant_labels);
        let mut m = enc.encode_descriptor(
            "rankgate_flow_tenant_tokens",
            "Tokens each of the busiest tenants has cost (prompt at dispatch, output as it \
             streams); the others summed as tenant=\"~other\". Which tenants are named changes \
             with their load",
            None,
            MetricType::Counter,
        )?;
        for t in &top {
            let labels = [("tenant", &*t.name)];
            ConstCounter::new(t.tokens.load(Relaxed)).encode(m.encode_family(&labels)?)?;
        }
        let labels = [("tenant", "~other")];
        ConstCounter::new(other[0]).encode(m.encode_family(&labels)?)?;
        let m = enc.encode_descriptor(
            "rankgate_flow_tenants",
            "Tenants flow control tracks now (bounded by flow.max_tenants)",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(flows.tenants().len() as i64).encode(m)?;
        Ok(())
    }
}

/// The `/flows` page: each objective with its queue and counts, and the busiest tenants.
pub fn page(flows: &Flows) -> Value {
    let per_band = flows.per_band();
    let objectives: Vec<Value> = (flows.cfg.objectives.iter().zip(flows.stats.iter()))
        .enumerate()
        .map(|(i, (o, s))| {
            let rejected: serde_json::Map<String, Value> = (REASONS.iter().zip(&s.rejected))
                .map(|(r, n)| (r.to_string(), n.load(Relaxed).into()))
                .collect();
            json!({
                "name": o.name,
                "priority": o.priority,
                "weight": o.weight,
                "max_wait_ms": o.max_wait.as_millis() as u64,
                "engine_priority": o.engine_priority,
                "queued": s.queued.load(Relaxed).max(0),
                "band_queued": per_band.get(flows.band_of[i]).copied().unwrap_or(0),
                "dispatched_direct": s.direct.load(Relaxed),
                "dispatched_after_wait": s.dispatched.load(Relaxed),
                "rejected": rejected,
            })
        })
        .collect();
    let (top, other) = busiest(&flows.tenants(), flows.cfg.tenant_labels);
    let tenants: Vec<Value> = (top.iter())
        .map(|t| {
            json!({
                "tenant": &*t.name,
                "queued": t.queued.load(Relaxed),
                "queued_bytes": t.queued_bytes.load(Relaxed),
                "in_flight": t.in_flight.load(Relaxed),
                "tokens": t.tokens.load(Relaxed),
                "dispatched": t.dispatched.load(Relaxed),
                "rejected": t.rejected.load(Relaxed),
            })
        })
        .collect();
    json!({
        "enabled": true,
        "waiting": flows.waiting(),
        "objectives": objectives,
        "tenants": tenants,
        "other_tenants": { "tokens": other[0], "in_flight": other[1], "queued": other[2] },
        "tenants_tracked": flows.tenants().len(),
        "saturation": {
            "max_waiting": flows.cfg.saturation.max_waiting,
            "max_kv": flows.cfg.saturation.max_kv,
            "max_running": flows.cfg.saturation.max_running,
        },
    })
}
