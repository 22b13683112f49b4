//! The disaggregation series a vLLM role server adds to `/metrics`, with vLLM 0.32's names and
//! labels (the fixtures' 3_metrics.json): one series per rank, labelled `engine` like the
//! sim's other series, dark ranks left out with the rest.

use std::fmt::Write as _;

use crate::sim::{Sim, SimFlavor};

impl Sim {
    /// Appends the PD series to a `/metrics` body; nothing without a role or for SGLang.
    pub(crate) fn render_pd_metrics(&self, o: &mut String) {
        if self.cfg.role.is_none() || self.cfg.flavor != SimFlavor::Vllm {
            return;
        }
        let model = self.default_model();
        // (global rank, local index) of each published rank.
        let ranks: Vec<(u32, usize)> = self
            .rank_reports()
            .iter()
            .map(|r| (r.global, (r.global - self.cfg.start_rank) as usize))
            .collect();
        let counts: Vec<_> = (self.pd.ranks.iter()).map(|c| c.counts()).collect();
        let cache_hits: Vec<u64> = self.ranks.iter().map(|r| r.counts().prefix_hits).collect();
        let name = "vllm:prompt_tokens_by_source_total";
        let _ = writeln!(
            o,
            "# HELP {name} Number of prompt tokens by source.\n# TYPE {name} counter"
        );
        for &(g, l) in &ranks {
            let c = counts[l];
            for (source, v) in [
                ("local_compute", c.local_compute),
                ("local_cache_hit", cache_hits[l]),
                ("external_kv_transfer", c.external_kv_transfer),
            ] {
                let _ = writeln!(
                    o,
                    "{name}{{engine=\"{g}\",model_name=\"{model}\",source=\"{source}\"}} {:?}",
                    v as f64
                );
            }
        }
        let h = "vllm:nixl_bytes_transferred";
        let _ = writeln!(
            o,
            "# HELP {h} Number of bytes transferred per NIXL transfer.\n# TYPE {h} histogram"
        );
        for &(g, l) in &ranks {
            let c = counts[l];
            let labels = format!("engine=\"{g}\",model_name=\"{model}\"");
            let _ = writeln!(
                o,
                "{h}_bucket{{engine=\"{g}\",le=\"+Inf\",model_name=\"{model}\"}} {:?}\n\
                 {h}_count{{{labels}}} {:?}\n{h}_sum{{{labels}}} {:?}",
                c.transfers as f64, c.transfers as f64, c.bytes_transferred as f64
            );
        }
        for (name, help, pick) in [
            (
                "vllm:nixl_num_failed_transfers_total",
                "Number of failed NIXL KV Cache transfers.",
                0,
            ),
            (
                "vllm:nixl_num_kv_expired_reqs_total",
                "Number of requests that had their KV expire.",
                1,
            ),
            (
                "vllm:nixl_num_notifications_after_expiry_total",
                "Number of notifications received after the KV had expired.",
                2,
            ),
        ] {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
            for &(g, l) in &ranks {
                let c = counts[l];
                let v = match pick {
                    0 => c.failed_transfers,
                    1 => c.expired,
                    _ => c.notifications_after_expiry,
                };
                let _ = writeln!(
                    o,
                    "{name}{{engine=\"{g}\",model_name=\"{model}\"}} {:?}",
                    v as f64
                );
            }
        }
    }
}
