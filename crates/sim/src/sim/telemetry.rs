//! What the simulated engine publishes about its ranks: `/metrics` in the engine's own format,
//! SGLang's `/v1/loads`, and the entries `GetLoads` answers with, all from one per-rank report so
//! that the three always agree.

use std::fmt::Write as _;

use http::{Response, StatusCode};
use serde_json::{json, Value};

use super::{read, Sim, SimBody, SimFlavor};
use rankgate::http::{json_response, openai_error};

/// One rank's published numbers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RankReport {
    pub global: u32,
    pub usage: f64,
    pub running: i64,
    pub waiting: i64,
    /// Of the waiting, those set aside for want of a LoRA slot (vLLM's `deferred` reason).
    pub deferred: i64,
    pub used_tokens: i64,
    pub capacity: i64,
    /// Prompt tokens that looked up the prefix cache, and those found there (counters).
    pub prefix_queries: u64,
    pub prefix_hits: u64,
}

impl Sim {
    pub(crate) fn native_failing(&self) -> bool {
        read(&self.knobs).native_failing
    }

    /// What each published rank reports right now: dark ranks are left out, garbage ranks
    /// report NaN usage and negative counts. Shared by `/metrics`, `/v1/loads` and `GetLoads`.
    pub(crate) fn rank_reports(&self) -> Vec<RankReport> {
        let knobs = read(&self.knobs).clone();
        let total_capacity: u64 = self.ranks.iter().map(|r| r.capacity).sum();
        let fresh_silent =
            self.cfg.flavor == SimFlavor::Vllm && self.cfg.gauges_after_first_request;
        self.ranks
            .iter()
            .enumerate()
            .filter(|(_, r)| !knobs.dark_ranks.contains(&r.global))
            .map(|(i, rank)| (i, rank, rank.counts()))
            // A rank that has run nothing since the engine started publishes no gauges.
            .filter(|(_, _, c)| !fresh_silent || c.admitted > 0)
            .map(|(i, rank, c)| {
                let usage = knobs
                    .kv_usage
                    .get(i)
                    .copied()
                    .unwrap_or_else(|| rank.kv_usage());
                let garbage = self.cfg.garbage_ranks.contains(&rank.global);
                RankReport {
                    global: rank.global,
                    usage: if garbage { f64::NAN } else { usage },
                    running: if garbage { -1 } else { c.running as i64 },
                    waiting: c.waiting as i64,
                    deferred: c.lora.deferred as i64,
                    used_tokens: (usage * rank.capacity as f64).round() as i64,
                    // The real servicer reports the sum over ranks in every entry.
                    capacity: if self.cfg.servicer_quirks {
                        total_capacity
                    } else {
                        rank.capacity
                    } as i64,
                    prefix_queries: c.prefix_queries,
                    prefix_hits: c.prefix_hits,
                }
            })
            .collect()
    }

    /// The entries a load report carries for an optional `dp_rank` filter, with the servicer's
    /// semantics: an unmanaged rank is an error, an explicit 0 is a real filter.
    pub(crate) fn loads_for(&self, filter: Option<i64>) -> Result<Vec<RankReport>, String> {
        let reports = self.rank_reports();
        let Some(r) = filter else { return Ok(reports) };
        let range = self.cfg.start_rank as i64..(self.cfg.start_rank + self.cfg.dp_size) as i64;
        if !range.contains(&r) {
            return Err(format!(
                "dp_rank {r} is not managed by this server (ranks {range:?})"
            ));
        }
        if self.cfg.servicer_quirks {
            return Ok(reports);
        }
        Ok(reports
            .into_iter()
            .filter(|x| x.global as i64 == r)
            .collect())
    }

    /// SGLang's `GET /v1/loads[?dp_rank=N]`.
    pub(super) fn http_loads(&self, query: Option<&str>) -> Response<SimBody> {
        let filter = query
            .unwrap_or("")
            .split('&')
            .find_map(|kv| kv.strip_prefix("dp_rank="))
            .map(|v| v.parse::<i64>());
        let filter = match filter.transpose() {
            Ok(f) => f,
            Err(_) => {
                return openai_error(
                    StatusCode::BAD_REQUEST,
                    "BadRequestError",
                    "dp_rank must be an integer",
                )
            }
        };
        match self.loads_for(filter) {
            Ok(entries) => {
                let loads: Vec<Value> = entries
                    .iter()
                    .map(|e| {
                        json!({"dp_rank": e.global, "num_running_reqs": e.running, "num_waiting_reqs": e.waiting,
                            "num_total_reqs": e.running + e.waiting, "num_used_tokens": e.used_tokens,
                            "max_total_num_tokens": e.capacity,
                            // JSON has no NaN: a garbage rank reports an out-of-range usage.
                            "token_usage": if e.usage.is_finite() { e.usage } else { -1.0 }})
                    })
                    .collect();
                json_response(
                    StatusCode::OK,
                    &json!({"timestamp": "1970-01-01T00:00:00Z", "version": "sim",
                    "dp_rank_count": loads.len(), "loads": loads}),
                )
            }
            Err(msg) => openai_error(StatusCode::BAD_REQUEST, "BadRequestError", &msg),
        }
    }

    /// `/metrics` in the engine's own format: one series per rank, keyed by `engine` (vLLM) or
    /// `dp_rank` (SGLang), carrying GLOBAL rank ids.
    pub(super) fn render_metrics(&self) -> String {
        let (kv_name, run_name, wait_name, label) = match self.cfg.flavor {
            SimFlavor::Vllm => (
                "vllm:kv_cache_usage_perc",
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "engine",
            ),
            SimFlavor::Sglang => (
                "sglang:token_usage",
                "sglang:num_running_reqs",
                "sglang:num_queue_reqs",
                "dp_rank",
            ),
        };
        let model = self.default_model();
        let reports = self.rank_reports();
        let mut o = String::new();
        for (name, kind) in [(kv_name, 0), (run_name, 1), (wait_name, 2)] {
            let _ = writeln!(o, "# HELP {name} simulated\n# TYPE {name} gauge");
            for r in &reports {
                let value = match kind {
                    0 => r.usage.to_string(),
                    1 => r.running.to_string(),
                    _ => r.waiting.to_string(),
                };
                let _ = writeln!(
                    o,
                    "{name}{{{label}=\"{}\",model_name=\"{model}\"}} {value}",
                    r.global
                );
            }
        }
        if self.cfg.flavor == SimFlavor::Vllm {
            // vLLM 0.32 splits its waiting requests: those that wait for room (`capacity`) and
            // those set aside this step (`deferred`: a LoRA slot, here).
            let name = "vllm:num_requests_waiting_by_reason";
            let _ = writeln!(o, "# HELP {name} Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.\n# TYPE {name} gauge");
            for reason in ["capacity", "deferred"] {
                for r in &reports {
                    let n = match reason {
                        "capacity" => r.waiting - r.deferred,
                        _ => r.deferred,
                    };
                    let _ = writeln!(
                        o,
                        "{name}{{engine=\"{}\",model_name=\"{model}\",reason=\"{reason}\"}} {:?}",
                        r.global, n as f64
                    );
                }
            }
            // Counters exist for every rank from the start, gauges or not (dark ranks aside).
            let name = "vllm:request_success_total";
            let _ = writeln!(
                o,
                "# HELP {name} Count of successfully processed requests.\n# TYPE {name} counter"
            );
            let dark = read(&self.knobs).dark_ranks.clone();
            for r in self.ranks.iter().filter(|r| !dark.contains(&r.global)) {
                let finished = r.counts().finished as f64;
                let _ = writeln!(
                    o,
                    "{name}{{engine=\"{}\",finished_reason=\"stop\",model_name=\"{model}\"}} {finished:?}",
                    r.global
                );
            }
            o.push_str(
                "# HELP vllm:cache_config_info simulated\n# TYPE vllm:cache_config_info gauge\n",
            );
            for r in &reports {
                let _ = writeln!(
                    o,
                    "vllm:cache_config_info{{block_size=\"16\",engine=\"{}\",kv_cache_size_tokens=\"{}\",num_gpu_blocks=\"{}\"}} 1.0",
                    r.global,
                    r.capacity,
                    r.capacity / 16
                );
            }
            if self.cfg.prefix_caching {
                // vLLM's names, help texts and float rendering, as in a real scrape.
                for (name, help, hits) in [
                    (
                        "vllm:prefix_cache_queries_total",
                        "Prefix cache queries, in terms of number of queried tokens.",
                        false,
                    ),
                    (
                        "vllm:prefix_cache_hits_total",
                        "Prefix cache hits, in terms of number of cached tokens.",
                        true,
                    ),
                ] {
                    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
                    for r in &reports {
                        let v = if hits {
                            r.prefix_hits
                        } else {
                            r.prefix_queries
                        };
                        let _ = writeln!(
                            o,
                            "{name}{{engine=\"{}\",model_name=\"{model}\"}} {:?}",
                            r.global, v as f64
                        );
                    }
                }
            }
        }
        self.render_lora_metrics(&mut o);
        self.render_pd_metrics(&mut o);
        o
    }
}
