//! One simulated engine of a scenario's fleet: its shape, its speed, and the fault knobs it
//! starts with.

use serde::Deserialize;

use crate::sim::kv::KvEventsConfig;
use crate::sim::lora::{LoraConfig, LoraModule};
use crate::sim::{check_percent, check_status, SchedulingPolicy, SimConfig, SimFlavor};
use rankgate::config::HumanDuration;

/// One simulated engine of the fleet.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSpec {
    pub flavor: SimFlavor,
    pub dp_size: u32,
    /// Names the multi-server deployment this engine is a member of (with `start_rank`, its
    /// first global rank); without it the engine is its own deployment, ranks 0..dp_size.
    pub dp_group: Option<String>,
    #[serde(default)]
    pub start_rank: u32,
    #[serde(default = "default_capacity")]
    pub capacity_tokens: u64,
    #[serde(default)]
    pub capacities: Vec<u64>,
    #[serde(default)]
    pub preload: Vec<f64>,
    #[serde(default = "default_decode")]
    pub decode_rate: f64,
    /// Prompt tokens per second of prefill (tokens found in the prefix cache skip it).
    #[serde(default = "default_prefill")]
    pub prefill_rate: f64,
    /// vLLM's prefix caching (on by default, as in vLLM V1); prompts that share no prefix are
    /// unaffected by it.
    #[serde(default = "default_true")]
    pub prefix_caching: bool,
    /// Like vLLM's `--kv-events-config`: each rank publishes its prefix cache's KV events over
    /// ZeroMQ, bound on 127.0.0.1 with a free port per rank (read back from the engine's
    /// `GET /kv_event_sources`, which reports `tcp://*:PORT`). Needs `prefix_caching`.
    #[serde(default)]
    pub kv_events: bool,
    /// Ranks dark for the whole run, as this engine numbers them.
    #[serde(default)]
    pub dark_ranks: Vec<u32>,
    /// Fault knobs from the start (see `SimConfig`); events can change them mid-run.
    #[serde(default = "default_fail_status")]
    pub fail_status: u16,
    #[serde(default)]
    pub fail_percent: f64,
    #[serde(default)]
    pub hang_requests: bool,
    #[serde(default)]
    pub hang_metrics: bool,
    #[serde(default)]
    pub hang_models: bool,
    #[serde(default = "default_health_status")]
    pub health_status: u16,
    pub die_after: Option<u64>,
    pub stall_after_tokens: Option<u64>,
    /// Prefill/decode disaggregation: `"prefill"` or `"decode"` (the sim's `pd`); absent, the
    /// engine is colocated. Its side channels or bootstrap server take free ports.
    pub role: Option<crate::sim::PdRole>,
    /// Each rank's prefills run one at a time and hold up its decode steps while they run (the
    /// sim's `compute`): what a long prompt does to the requests decoding beside it.
    #[serde(default)]
    pub prefill_interference: bool,
    /// Like vLLM's `--max-num-seqs`: requests running per rank at most, the rest wait.
    #[serde(default = "default_max_num_seqs")]
    pub max_num_seqs: u32,
    /// Like vLLM's `--scheduling-policy`: `"fcfs"` (arrival) or `"priority"` (the body's
    /// `priority`, lower first); vLLM engines only.
    #[serde(default)]
    pub scheduling_policy: SchedulingPolicy,
    /// Like vLLM's `--enable-lora --lora-modules ...` (vLLM engines): the adapters served, each
    /// `name=path` or vLLM's JSON form (a path that is not a local one, `org/name`, needs no
    /// directory), each a model requests can name (`workload.models`).
    #[serde(default)]
    pub lora_modules: Vec<String>,
    /// Like vLLM's `--max-loras` (default 1, vLLM's): distinct adapters per rank's batch.
    pub max_loras: Option<u32>,
    /// How long loading an adapter into a rank's slot stalls the rank (default 25ms).
    pub lora_load: Option<HumanDuration>,
}

fn default_max_num_seqs() -> u32 {
    SimConfig::default().max_num_seqs
}

fn default_fail_status() -> u16 {
    503
}

fn default_health_status() -> u16 {
    200
}

fn default_capacity() -> u64 {
    4096
}

fn default_prefill() -> f64 {
    SimConfig::default().prefill_tokens_per_sec
}

fn default_true() -> bool {
    true
}

fn default_decode() -> f64 {
    100.0
}

impl EngineSpec {
    /// Everything wrong with the spec that would make the run fail or mean nothing.
    pub(super) fn validate(&self) -> Result<(), String> {
        if self.dp_size == 0 {
            return Err("dp_size must be at least 1".into());
        }
        if self.start_rank > 0 && self.dp_group.is_none() {
            return Err("start_rank numbers a member of a multi-server deployment: give dp_group too (an independent server's ranks are 0..dp_size)".into());
        }
        let own = self.start_rank..self.start_rank + self.dp_size;
        if let Some(r) = self.dark_ranks.iter().find(|r| !own.contains(r)) {
            return Err(format!(
                "dark rank {r} is not one of this engine's ranks ({}..{})",
                own.start, own.end
            ));
        }
        if !(self.decode_rate.is_finite() && self.decode_rate > 0.0) {
            return Err("decode_rate must be a positive number".into());
        }
        if !(self.prefill_rate.is_finite() && self.prefill_rate > 0.0) {
            return Err("prefill_rate must be a positive number".into());
        }
        if self.capacity_tokens == 0 || self.capacities.contains(&0) {
            return Err("capacities must be positive".into());
        }
        if self.preload.iter().any(|p| !(0.0..=1.0).contains(p)) {
            return Err("preload values must be within [0, 1]".into());
        }
        check_status(self.fail_status).map_err(|x| format!("fail_status: {x}"))?;
        check_percent(self.fail_percent).map_err(|x| format!("fail_percent: {x}"))?;
        check_status(self.health_status).map_err(|x| format!("health_status: {x}"))?;
        if self.die_after == Some(0) {
            return Err("die_after must be at least 1".into());
        }
        self.sim_queue().check_queue()?;
        SimConfig {
            lora: self.lora()?,
            ..self.sim_queue()
        }
        .check_lora()?;
        if self.kv_events && !self.prefix_caching {
            return Err(
                "kv_events needs prefix_caching (the events are the prefix cache's)".into(),
            );
        }
        Ok(())
    }

    pub(super) fn sim_config(&self) -> SimConfig {
        SimConfig {
            flavor: self.flavor,
            dp_size: self.dp_size,
            start_rank: self.start_rank,
            capacity_tokens: self.capacity_tokens,
            capacities: self.capacities.clone(),
            preload: self.preload.clone(),
            dark_ranks: self.dark_ranks.clone(),
            decode_tokens_per_sec: self.decode_rate,
            prefill_tokens_per_sec: self.prefill_rate,
            prefill_interference: self.prefill_interference,
            prefix_caching: self.prefix_caching,
            kv_events: self.kv_events.then(KvEventsConfig::bind_local),
            // An engine publishing events names its blocks by the tiny model's real token ids,
            // which the router's `[[models]]` tokenizer computes too.
            tokenizer: self
                .kv_events
                .then(|| {
                    crate::sim::model::tiny_model_dir()
                        .and_then(|d| crate::sim::model::tokenizer(&d))
                })
                .and_then(|t| {
                    t.map_err(
                        |e| tracing::warn!(error = %e, "no tokenizer: the stand-in names blocks"),
                    )
                    .ok()
                }),
            fail_status: self.fail_status,
            fail_percent: self.fail_percent,
            hang_requests: self.hang_requests,
            hang_metrics: self.hang_metrics,
            hang_models: self.hang_models,
            health_status: self.health_status,
            die_after: self.die_after,
            stall_after_tokens: self.stall_after_tokens,
            role: self.role,
            // Checked by `validate`.
            lora: self.lora().ok().flatten(),
            ..self.sim_queue()
        }
    }

    /// The LoRA settings the keys give: `None` without `lora_modules`.
    fn lora(&self) -> Result<Option<LoraConfig>, String> {
        if self.lora_modules.is_empty() {
            if self.max_loras.is_some() || self.lora_load.is_some() {
                return Err("max_loras and lora_load need lora_modules".into());
            }
            return Ok(None);
        }
        let d = LoraConfig::default();
        Ok(Some(LoraConfig {
            modules: (self.lora_modules.iter())
                .map(|m| {
                    LoraModule::parse(m).map_err(|e| e.replace("--lora-modules", "lora_modules"))
                })
                .collect::<Result<_, _>>()?,
            max_loras: self.max_loras.unwrap_or(d.max_loras),
            load_delay: self.lora_load.map_or(d.load_delay, |l| l.0),
            ..d
        }))
    }

    /// Whether the engine serves LoRA adapters.
    pub fn serves_adapters(&self) -> bool {
        !self.lora_modules.is_empty()
    }

    /// Its `--max-loras`: the key, else vLLM's default.
    pub fn max_loras_or_default(&self) -> u32 {
        self.max_loras.unwrap_or(LoraConfig::default().max_loras)
    }

    /// The default engine with this spec's flavor and queue settings.
    fn sim_queue(&self) -> SimConfig {
        SimConfig {
            flavor: self.flavor,
            max_num_seqs: self.max_num_seqs,
            scheduling_policy: self.scheduling_policy,
            ..SimConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(extra: &str) -> Result<EngineSpec, String> {
        let text = format!("flavor = \"vllm\"\ndp_size = 1\n{extra}");
        let s: EngineSpec = toml::from_str(&text).map_err(|e| e.to_string())?;
        s.validate().map(|()| s)
    }

    #[test]
    fn queue_keys_reach_the_engine_and_bad_ones_are_refused() {
        let d = spec("").expect("valid").sim_config();
        assert_eq!(d.max_num_seqs, SimConfig::default().max_num_seqs);
        assert_eq!(d.scheduling_policy, SchedulingPolicy::Fcfs);
        let s = spec("max_num_seqs = 4\nscheduling_policy = \"priority\"").expect("valid");
        let cfg = s.sim_config();
        assert_eq!(cfg.max_num_seqs, 4);
        assert_eq!(cfg.scheduling_policy, SchedulingPolicy::Priority);
        assert_eq!(cfg.flavor, SimFlavor::Vllm);
        let e = spec("max_num_seqs = 0").unwrap_err();
        assert!(e.contains("max_num_seqs"), "{e}");
        let e = spec("scheduling_policy = \"lifo\"").unwrap_err();
        assert!(e.contains("lifo") || e.contains("variant"), "{e}");
        let text = "flavor = \"sglang\"\ndp_size = 1\nscheduling_policy = \"priority\"";
        let s: EngineSpec = toml::from_str(text).expect("parses");
        assert!(s.validate().unwrap_err().contains("scheduling_policy"));
    }

    #[test]
    fn lora_keys_reach_the_engine_and_bad_ones_are_refused() {
        assert!(spec("").unwrap().sim_config().lora.is_none());
        let s =
            spec("lora_modules = [\"a=org/a\", \"b=org/b\"]\nmax_loras = 2\nlora_load = \"5ms\"")
                .expect("valid");
        let l = s.sim_config().lora.expect("on");
        assert_eq!((l.modules.len(), l.max_loras), (2, 2));
        assert_eq!(l.load_delay, std::time::Duration::from_millis(5));
        assert_eq!(
            spec("lora_modules = [\"a=org/a\"]")
                .unwrap()
                .sim_config()
                .lora
                .unwrap()
                .max_loras,
            1,
            "vLLM's default"
        );
        for (extra, says) in [
            ("max_loras = 2", "need lora_modules"),
            ("lora_modules = [\"a=org/a\"]\nmax_loras = 0", "max_loras"),
            ("lora_modules = [\"nothing\"]", "lora_modules"),
            ("lora_modules = [\"a=org/a\", \"a=org/b\"]", "named twice"),
        ] {
            let e = spec(extra).unwrap_err();
            assert!(e.contains(says), "{extra}: {e}");
        }
        let text = "flavor = \"sglang\"\ndp_size = 1\nlora_modules = [\"a=org/a\"]";
        let s: EngineSpec = toml::from_str(text).expect("parses");
        assert!(s.validate().unwrap_err().contains("vLLM"));
    }
}
