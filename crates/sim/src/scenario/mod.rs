//! Routing-quality scenarios: a fleet of simulated engines, a workload and a timeline of events,
//! described in one TOML file (`configs/scenarios/`), run once per policy against a fresh fleet
//! and router, with per-rank KV sampled over time. Engines can misbehave from the start or from
//! a point in the timeline (`events`), using the simulator's fault knobs.
//!
//! Every policy sees the same arrivals (the workload's seed is fixed) and a fleet started from the
//! same state, so the differences in the results are the router's doing.
//!
//! What is compared are router variants (`variant`: a policy, optionally with prefix affinity
//! and flow control), each with one or several rankgate replicas side by side; `run` drives one
//! of them, with the router configuration `router_config` writes. The workload is one, or
//! several tenants at once (`tenant`) told apart by their headers.

mod engine;
mod events;
pub mod render;
mod router_config;
mod run;
mod tenant;
mod variant;

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::load::{self, Api, Burst, Dist, HotPrefix, ModelSpread, Sessions};
pub use engine::EngineSpec;
pub use events::{Event, Limit};
use rankgate::config::{HumanDuration, Policy};
pub use router_config::flow_section;
pub use run::{run, run_fleet, run_policy, Fleet, PolicyRun, RankResult};
pub use tenant::TenantSpec;
pub use variant::{Replicas, Variant};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadSpec {
    #[serde(default = "default_api")]
    pub api: Api,
    #[serde(default = "default_true")]
    pub stream: bool,
    /// Open loop: arrivals per second (not with `tenants`, which carry their own).
    pub rate: Option<f64>,
    /// Closed loop: concurrent users.
    pub concurrency: Option<usize>,
    /// Required, unless every tenant gives its own.
    pub requests: Option<usize>,
    /// Bounds the whole run, every tenant's included.
    pub duration: HumanDuration,
    /// Required unless the workload is `sessions`, whose prompts are their own (or every tenant
    /// gives its own).
    pub prompt_tokens: Option<Dist>,
    /// Required, unless every tenant gives its own.
    pub output_tokens: Option<Dist>,
    /// Multi-turn chat sessions instead of independent requests.
    pub sessions: Option<Sessions>,
    /// A share of the requests starting with one long shared prefix.
    pub hot_prefix: Option<HotPrefix>,
    /// A JSONL trace, relative to the scenario file.
    pub trace: Option<String>,
    #[serde(default)]
    pub bursts: Vec<Burst>,
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Over gRPC: the engines serve their gRPC side only (`grpc_url`) and the workload streams
    /// `Generate` calls through rankgate's gRPC front door.
    #[serde(default)]
    pub grpc: bool,
    /// Model names the requests are spread over (LoRA adapters, each served as a model);
    /// empty, the engines' default model. Tenants may give their own.
    #[serde(default)]
    pub models: Vec<String>,
    /// How requests are spread over `models`: `"even"` (in turn) or `"random"`.
    #[serde(default)]
    pub model_spread: ModelSpread,
    /// Several tenants at once instead of one workload, each named to the router by headers
    /// (`[[workload.tenants]]`); the fields above are their defaults.
    #[serde(default)]
    pub tenants: Vec<TenantSpec>,
}

impl WorkloadSpec {
    /// The one workload's arrivals and sizes, or its tenants.
    fn validate(&self) -> Result<(), String> {
        load::check_models(&self.models).map_err(|e| format!("workload.models: {e}"))?;
        if self.grpc && !self.models.is_empty() {
            return Err("workload.models: gRPC Generate names no model (HTTP only)".into());
        }
        if !self.tenants.is_empty() {
            if self.rate.is_some() || self.concurrency.is_some() {
                return Err(
                    "workload: with tenants, each tenant gives its own `rate` or `concurrency`"
                        .into(),
                );
            }
            if self.grpc || self.trace.is_some() || !self.bursts.is_empty() {
                return Err(
                    "workload.tenants are told apart by HTTP headers: no grpc, trace or bursts"
                        .into(),
                );
            }
            let mut names = std::collections::BTreeSet::new();
            for (i, t) in self.tenants.iter().enumerate() {
                t.validate(self)
                    .map_err(|e| format!("workload.tenants[{i}] ({:?}): {e}", t.name))?;
                if !names.insert(t.name.as_str()) {
                    return Err(format!("workload.tenants: {:?} is named twice", t.name));
                }
            }
            return Ok(());
        }
        if self.rate.is_some_and(|r| !(r.is_finite() && r > 0.0)) || self.concurrency == Some(0) {
            return Err("workload `rate` and `concurrency` must be positive".into());
        }
        if self.rate.is_some() == self.concurrency.is_some() {
            return Err(
                "workload needs exactly one of `rate` (open loop) or `concurrency` (closed loop)"
                    .into(),
            );
        }
        if self.requests.is_none() || self.output_tokens.is_none() {
            return Err("workload needs `requests` and `output_tokens` (or [[workload.tenants]] giving them)".into());
        }
        if self.prompt_tokens.is_none() && self.sessions.is_none() {
            return Err("workload needs `prompt_tokens` (or [workload.sessions])".into());
        }
        if let Some(sessions) = &self.sessions {
            sessions.validate().map_err(|e| format!("workload.{e}"))?;
            if self.grpc || self.api != Api::Chat || self.trace.is_some() || !self.bursts.is_empty()
            {
                return Err("workload.sessions are chat conversations over HTTP: no grpc, trace or bursts, api = \"chat\"".into());
            }
        }
        if let Some(h) = &self.hot_prefix {
            h.validate().map_err(|e| format!("workload.{e}"))?;
        }
        Ok(())
    }
}

fn default_api() -> Api {
    Api::Chat
}

fn default_true() -> bool {
    true
}

fn default_seed() -> u64 {
    7
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterSpec {
    #[serde(default = "default_interval")]
    pub interval: HumanDuration,
    #[serde(default = "default_stale")]
    pub stale_after: HumanDuration,
    /// Rankgate routers side by side in front of the same fleet, each with its own polls and no
    /// shared state, each sent 1/N of the requests; a list runs every variant once per count.
    #[serde(default)]
    pub replicas: Replicas,
}

fn default_interval() -> HumanDuration {
    HumanDuration(Duration::from_millis(100))
}

fn default_stale() -> HumanDuration {
    HumanDuration(Duration::from_secs(1))
}

impl Default for RouterSpec {
    fn default() -> Self {
        RouterSpec {
            interval: default_interval(),
            stale_after: default_stale(),
            replicas: Replicas::default(),
        }
    }
}

/// A scenario file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// Router variants: `least_kv`, `least_kv+affinity`, `round_robin`, `random`; `+flow` last
    /// for flow control (the `[flow]` table below).
    #[serde(default = "default_policies")]
    pub policies: Vec<Variant>,
    #[serde(default)]
    pub router: RouterSpec,
    pub engines: Vec<EngineSpec>,
    pub workload: WorkloadSpec,
    #[serde(default)]
    pub events: Vec<Event>,
    /// A disaggregated fleet's scenario: each variant also runs on the same engines with their
    /// roles taken away, every rank prefilling and decoding its own requests (same ranks, same
    /// rates, same KV), so colocated and disaggregated serving are compared on one hardware.
    #[serde(default)]
    pub also_colocated: bool,
    /// The router's `[flow]` section for the variants with `+flow`, passed on as written.
    pub flow: Option<toml::Table>,
    /// The router's `[[routes]]` (model routes: an alias, a canary), for every variant, passed
    /// on as written.
    #[serde(default)]
    pub routes: Vec<toml::Table>,
    /// Set by `load` from `workload.trace`.
    #[serde(skip)]
    pub trace: Option<Vec<load::TraceEntry>>,
}

fn default_policies() -> Vec<Variant> {
    [Policy::LeastKv, Policy::RoundRobin, Policy::Random]
        .map(Variant::from)
        .to_vec()
}

impl Scenario {
    /// Parses scenario text; `dir` resolves a relative trace path.
    pub fn parse(text: &str, dir: Option<&Path>) -> Result<Scenario, String> {
        let mut s: Scenario = toml::from_str(text).map_err(|e| e.message().to_string())?;
        if s.engines.is_empty() {
            return Err("a scenario needs at least one [[engines]]".into());
        }
        if s.workload.grpc && s.engines.iter().any(|e| e.flavor != s.engines[0].flavor) {
            return Err(
                "a gRPC workload calls one flavor's service: give every engine the same flavor"
                    .into(),
            );
        }
        for (i, e) in s.engines.iter().enumerate() {
            e.validate().map_err(|why| format!("engines[{i}]: {why}"))?;
        }
        for (i, ev) in s.events.iter().enumerate() {
            ev.validate(s.engines.len(), s.ranks().len())
                .map_err(|why| format!("events[{i}] (at {:?}): {why}", ev.at.0))?;
        }
        let w = &s.workload;
        w.validate()?;
        s.router.replicas.validate()?;
        if let Some(v) = s.policies.iter().find(|v| v.flow && s.flow.is_none()) {
            return Err(format!(
                "policies: {:?} gives the router the scenario's [flow] table: add one",
                v.as_str()
            ));
        }
        if w.grpc && s.router.replicas.counts().iter().any(|&n| n > 1) {
            return Err(
                "router.replicas > 1 spreads HTTP requests: not with a gRPC workload".into(),
            );
        }
        if s.also_colocated && !s.disaggregated() {
            return Err("also_colocated compares a disaggregated fleet with itself colocated: give some [[engines]] a role".into());
        }
        if s.disaggregated() && w.grpc {
            return Err("a disaggregated fleet is served over HTTP (rankgate's gRPC front door does not split requests)".into());
        }
        if s.policies.is_empty() {
            return Err("policies: give at least one variant".into());
        }
        if let Some(t) = &s.workload.trace {
            let path = dir.map_or_else(|| Path::new(t).to_path_buf(), |d| d.join(t));
            let text = std::fs::read_to_string(&path)
                .map_err(|e| format!("trace {}: {e}", path.display()))?;
            s.trace = Some(load::dist::read_trace(&text)?);
        }
        Ok(s)
    }

    pub fn load(path: &Path) -> Result<Scenario, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Scenario::parse(&text, path.parent()).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Whether some engine has a prefill or decode role.
    pub fn disaggregated(&self) -> bool {
        self.engines.iter().any(|e| e.role.is_some())
    }

    /// The fleet's ranks in engine order: (engine index, the rank as that engine numbers it:
    /// 0.. for an independent server, global for a group member). A scenario's "rank N"
    /// (events' `dark`, the result tables) is the Nth of these.
    pub fn ranks(&self) -> Vec<(usize, u32)> {
        (self.engines.iter().enumerate())
            .flat_map(|(i, e)| (e.start_rank..e.start_rank + e.dp_size).map(move |r| (i, r)))
            .collect()
    }

    /// The windows during which each fleet rank (see [`Scenario::ranks`]) publishes no
    /// telemetry: (rank, from, until).
    pub fn dark_windows(&self) -> Vec<(usize, Duration, Duration)> {
        let end = self.workload.duration.0;
        let ranks = self.ranks();
        let mut out = Vec::new();
        for (n, (e, r)) in ranks.iter().enumerate() {
            if self.engines[*e].dark_ranks.contains(r) {
                out.push((n, Duration::ZERO, end));
            }
        }
        // Only events that say `dark` change the dark set, so only they end a window.
        let mut events: Vec<(Duration, &[usize])> = self
            .events
            .iter()
            .filter_map(|e| e.dark.as_deref().map(|d| (e.at.0, d)))
            .collect();
        events.sort_by_key(|e| e.0);
        for (i, &(at, dark)) in events.iter().enumerate() {
            let until = events.get(i + 1).map_or(end, |n| n.0);
            out.extend(dark.iter().map(|&r| (r, at, until)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"
name = "t"
[[engines]]
flavor = "vllm"
dp_size = 2
dark_ranks = [1]
[workload]
rate = 5
requests = 10
duration = "10s"
prompt_tokens = "normal:100:10"
output_tokens = 16
[[events]]
at = "2s"
dark = [0]
[[events]]
at = "4s"
dark = []
"#;

    #[test]
    fn parses_and_derives_dark_windows() {
        let s = Scenario::parse(TEXT, None).unwrap();
        assert_eq!(s.policies.len(), 3);
        assert_eq!(s.ranks(), [(0, 0), (0, 1)]);
        let w = s.dark_windows();
        assert!(w.contains(&(1, Duration::ZERO, Duration::from_secs(10))));
        assert!(w.contains(&(0, Duration::from_secs(2), Duration::from_secs(4))));
        assert_eq!(w.len(), 2);
    }

    #[test]
    fn rejects_unknown_keys_and_ambiguous_arrivals() {
        assert!(Scenario::parse(&TEXT.replace("dp_size", "dp_sise"), None).is_err());
        let e = Scenario::parse(&TEXT.replace("rate = 5", "rate = 5\nconcurrency = 2"), None)
            .unwrap_err();
        assert!(e.contains("exactly one"), "{e}");
        let e = Scenario::parse(
            &TEXT.replace("dp_size = 2", "dp_size = 2\ndecode_rate = 0"),
            None,
        )
        .unwrap_err();
        assert!(e.contains("engines[0]: decode_rate"), "{e}");
        assert!(Scenario::parse(&TEXT.replace("rate = 5", "rate = -1"), None).is_err());
    }

    #[test]
    fn variants_replicas_and_session_workloads_are_checked() {
        let s = Scenario::parse(
            &TEXT.replace(
                "name = \"t\"",
                "name = \"t\"\npolicies = [\"least_kv\", \"least_kv+affinity\"]\n[router]\nreplicas = [1, 3]",
            ),
            None,
        )
        .unwrap();
        assert_eq!(s.policies[1].as_str(), "least_kv+affinity");
        assert_eq!(s.router.replicas.counts(), [1, 3]);
        let e = Scenario::parse(
            &TEXT.replace(
                "name = \"t\"",
                "name = \"t\"\npolicies = [\"least_kv+sticky\"]",
            ),
            None,
        )
        .unwrap_err();
        assert!(e.contains("sticky"), "{e}");
        let e = Scenario::parse(
            &TEXT.replace("prompt_tokens = \"normal:100:10\"\n", ""),
            None,
        )
        .unwrap_err();
        assert!(e.contains("prompt_tokens"), "{e}");
        let sessions =
            "[workload.sessions]\ncount = 2\nturns = 0\nsystem_tokens = 10\nuser_tokens = 5\n";
        let e = Scenario::parse(
            &TEXT.replacen("[[events]]", &format!("{sessions}[[events]]"), 1),
            None,
        )
        .unwrap_err();
        assert!(
            e.contains("workload.sessions") && e.contains("turns"),
            "{e}"
        );
        let hot = "[workload.hot_prefix]\nshare = 1.5\ntokens = 100\n";
        let e = Scenario::parse(
            &TEXT.replacen("[[events]]", &format!("{hot}[[events]]"), 1),
            None,
        )
        .unwrap_err();
        assert!(e.contains("hot_prefix") && e.contains("share"), "{e}");
    }

    #[test]
    fn colocated_comparisons_need_roles_and_http() {
        let with = |extra: &str| TEXT.replace("name = \"t\"", &format!("name = \"t\"\n{extra}"));
        let e = Scenario::parse(&with("also_colocated = true"), None).unwrap_err();
        assert!(e.contains("also_colocated"), "{e}");
        let pd = with("also_colocated = true").replace("dark_ranks = [1]", "role = \"decode\"");
        let s = Scenario::parse(&pd, None).unwrap();
        assert!(s.disaggregated() && s.also_colocated);
        let e = Scenario::parse(&pd.replace("[workload]", "[workload]\ngrpc = true"), None)
            .unwrap_err();
        assert!(e.contains("over HTTP"), "{e}");
    }

    #[test]
    fn shipped_scenarios_parse() {
        // The scenarios live at the repository root, two levels above this crate.
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/scenarios");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            if p.extension().is_some_and(|x| x == "toml") {
                Scenario::load(&p).unwrap();
                n += 1;
            }
        }
        assert!(
            n >= 5,
            "expected the five scenarios and the demo, found {n}"
        );
    }
}
