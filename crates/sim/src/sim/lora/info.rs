//! What the engine publishes about its adapters in `/metrics`.
//!
//! `vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}` as vLLM
//! 0.32 publishes it (`vllm/v1/metrics/loggers.py`, `PrometheusStatLogger.record`; fixtures
//! `tests/fixtures/vllm-0.32-lora/metrics-lora-*.txt`): a gauge whose value is the unix time of
//! its last update (`set_to_current_time`), one series per label set ever published, the newest
//! being the current state, and no `engine` label. Its labels are the keys of the API server's
//! `LoRARequestStates` (`vllm/v1/metrics/stats.py`), which learns of a request from the events
//! that come with its outputs: QUEUED and SCHEDULED arrive together with its first token, so an
//! adapter shows once a request of it runs, and stays until the last one ends; both labels list
//! the same names (`update_scheduler_stats` fills both maps with every adapter it tracks), in the
//! order the adapters came. vLLM records the series at every engine step; the sim records it
//! when a generation starts or ends and, while any runs, at every scrape, which keeps the
//! newest series the current one. With DP, the API server's one `LoRARequestStates` covers every
//! rank, so the labels are the union over ranks (vLLM warns the gauge may mislead with DP).
//!
//! The sim's own counters, per rank (`engine` label): `sim_lora_slot_waits_total`, requests set
//! aside for want of a slot (each once), and `sim_lora_loads_total`, adapters loaded into a slot.

use std::fmt::Write as _;
use std::sync::Arc;

use super::super::{lock, read, Sim};

/// Label sets the gauge remembers at most; past it the one updated longest ago goes. vLLM keeps
/// every one it ever published.
pub(super) const MAX_SERIES: usize = 1024;

/// The gauge's state.
#[derive(Debug, Default)]
pub(super) struct Info {
    /// Adapters with a running request, in the order they came, with how many run.
    active: Vec<(Arc<str>, u32)>,
    /// Every label (the adapters, comma-separated) published, with its last update (unix s).
    series: Vec<(String, f64)>,
    /// Generations running, base model's included: while any runs, steps run.
    running: u64,
}

impl Info {
    /// A generation (of adapter `name`, or of the base model) started.
    pub(super) fn start(&mut self, name: Option<&Arc<str>>) {
        self.running += 1;
        if let Some(n) = name {
            match self.active.iter_mut().find(|(a, _)| a == n) {
                Some((_, c)) => *c += 1,
                None => self.active.push((n.clone(), 1)),
            }
        }
        self.record();
    }

    /// A generation ended.
    pub(super) fn finish(&mut self, name: Option<&Arc<str>>) {
        self.running = self.running.saturating_sub(1);
        if let Some(i) = name.and_then(|n| self.active.iter().position(|(a, _)| a == n)) {
            self.active[i].1 -= 1;
            if self.active[i].1 == 0 {
                self.active.remove(i);
            }
        }
        self.record();
    }

    /// Sets the current label set's series to now.
    fn record(&mut self) {
        let label = (self.active.iter())
            .map(|(a, _)| &**a)
            .collect::<Vec<_>>()
            .join(",");
        let now = (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH))
            .map_or(0.0, |d| d.as_secs_f64());
        if let Some((_, t)) = self.series.iter_mut().find(|(l, _)| *l == label) {
            *t = now;
            return;
        }
        if self.series.len() >= MAX_SERIES {
            let oldest = (self.series.iter().enumerate())
                .min_by(|a, b| a.1 .1.total_cmp(&b.1 .1))
                .map(|(i, _)| i);
            if let Some(i) = oldest {
                self.series.remove(i);
            }
        }
        self.series.push((label, now));
    }
}

/// A float as Prometheus' Python client writes it (`floatToGoString`): Python's shortest form,
/// with an exponent past six digits before the point, as Go writes it (`1.7965651e+09`).
pub(crate) fn go_float(v: f64) -> String {
    let mut s = format!("{v}");
    if v.is_finite() && !s.contains(['.', 'e', 'E']) {
        s.push_str(".0");
    }
    match s.find('.') {
        Some(dot) if v > 0.0 && dot > 6 => {
            let digits = format!("{}.{}{}", &s[..1], &s[1..dot], &s[dot + 1..]);
            let mantissa = digits.trim_end_matches(['0', '.']);
            format!("{mantissa}e+0{}", dot - 1)
        }
        _ => s,
    }
}

impl Sim {
    /// The LoRA series of `/metrics` (vLLM flavor with LoRA on; nothing else).
    pub(crate) fn render_lora_metrics(&self, o: &mut String) {
        let Some(lora) = &self.lora else { return };
        let name = "vllm:lora_requests_info";
        let _ = writeln!(
            o,
            "# HELP {name} Running stats on lora requests.\n# TYPE {name} gauge"
        );
        {
            let mut info = lock(&lora.info);
            if info.running > 0 {
                // A step would just have recorded it.
                info.record();
            }
            let max = lora.cfg.max_loras;
            for (label, t) in &info.series {
                let _ = writeln!(
                    o,
                    "{name}{{max_lora=\"{max}\",running_lora_adapters=\"{label}\",waiting_lora_adapters=\"{label}\"}} {}",
                    go_float(*t)
                );
            }
        }
        let dark = read(&self.knobs).dark_ranks.clone();
        let ranks: Vec<_> = (self.ranks.iter())
            .filter(|r| !dark.contains(&r.global))
            .map(|r| (r.global, r.counts().lora))
            .collect();
        for (name, help, waits) in [
            (
                "sim_lora_slot_waits_total",
                "Requests set aside for want of a LoRA slot in their rank's batch (each once).",
                true,
            ),
            (
                "sim_lora_loads_total",
                "LoRA adapters loaded into a rank's slot.",
                false,
            ),
        ] {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
            for (global, c) in &ranks {
                let v = if waits { c.waits } else { c.loads };
                let _ = writeln!(o, "{name}{{engine=\"{global}\"}} {v}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_are_written_as_prometheus_python_client_writes_them() {
        assert_eq!(go_float(1_796_565_156.896_617), "1.796565156896617e+09");
        assert_eq!(go_float(1_796_565_156.0), "1.796565156e+09");
        assert_eq!(go_float(0.0), "0.0");
        assert_eq!(go_float(2.5), "2.5");
    }

    #[test]
    fn labels_list_running_adapters_in_the_order_they_came_and_every_set_stays() {
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        let mut info = Info::default();
        info.start(None);
        info.start(Some(&b));
        info.start(Some(&a));
        info.start(Some(&b));
        info.finish(Some(&b));
        info.finish(Some(&b));
        info.finish(Some(&a));
        info.finish(None);
        let labels: Vec<&str> = info.series.iter().map(|(l, _)| l.as_str()).collect();
        assert_eq!(labels, ["", "b", "b,a", "a"]);
        assert!(info.series.iter().all(|(_, t)| *t > 1e9), "unix seconds");
        for i in 0..MAX_SERIES + 10 {
            let n: Arc<str> = format!("x{i}").into();
            info.start(Some(&n));
            info.finish(Some(&n));
        }
        assert_eq!(info.series.len(), MAX_SERIES, "bounded");
    }
}
