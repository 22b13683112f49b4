//! Routing-quality scenarios: a fleet of simulated engines, a workload and a timeline of events,
//! described in one TOML file (`configs/scenarios/`), run once per policy against a fresh fleet
//! and router, with per-rank KV sampled over time. Engines can misbehave from the start or from
//! a point in the timeline (`events`), using the simulator's fault knobs.
//!
//! Every policy sees the same arrivals (the workload's seed is fixed) and a fleet started from the
//! same state, so the differences in the results are the router's doing.

mod engine;
mod events;
pub mod render;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use tokio::time::Instant;

use crate::app::Router;
use crate::config::{Config, HumanDuration, Policy};
use crate::load::{self, Api, Arrivals, Burst, Dist, Report, Workload};
use crate::sim::SimEngine;
pub use engine::EngineSpec;
pub use events::{Event, Limit};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadSpec {
    #[serde(default = "default_api")]
    pub api: Api,
    #[serde(default = "default_true")]
    pub stream: bool,
    /// Open loop: arrivals per second.
    pub rate: Option<f64>,
    /// Closed loop: concurrent users.
    pub concurrency: Option<usize>,
    pub requests: usize,
    pub duration: HumanDuration,
    pub prompt_tokens: Dist,
    pub output_tokens: Dist,
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
    #[serde(default = "default_policies")]
    pub policies: Vec<Policy>,
    #[serde(default)]
    pub router: RouterSpec,
    pub engines: Vec<EngineSpec>,
    pub workload: WorkloadSpec,
    #[serde(default)]
    pub events: Vec<Event>,
    /// Set by `load` from `workload.trace`.
    #[serde(skip)]
    pub trace: Option<Vec<load::TraceEntry>>,
}

fn default_policies() -> Vec<Policy> {
    vec![Policy::LeastKv, Policy::RoundRobin, Policy::Random]
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
            ev.validate(s.engines.len())
                .map_err(|why| format!("events[{i}] (at {:?}): {why}", ev.at.0))?;
        }
        if s.workload.rate.is_some_and(|r| !(r.is_finite() && r > 0.0))
            || s.workload.concurrency == Some(0)
        {
            return Err("workload `rate` and `concurrency` must be positive".into());
        }
        if s.workload.rate.is_some() == s.workload.concurrency.is_some() {
            return Err(
                "workload needs exactly one of `rate` (open loop) or `concurrency` (closed loop)"
                    .into(),
            );
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

    /// Global ranks of the whole fleet, in engine order.
    pub fn ranks(&self) -> Vec<u32> {
        self.engines
            .iter()
            .flat_map(|e| e.start_rank..e.start_rank + e.dp_size)
            .collect()
    }

    /// The windows during which each GLOBAL rank publishes no telemetry: (rank, from, until).
    pub fn dark_windows(&self) -> Vec<(u32, Duration, Duration)> {
        let end = self.workload.duration.0;
        let mut out = Vec::new();
        for e in &self.engines {
            out.extend(e.dark_ranks.iter().map(|&r| (r, Duration::ZERO, end)));
        }
        // Only events that say `dark` change the dark set, so only they end a window.
        let mut events: Vec<(Duration, &[u32])> = self
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

/// One rank's results under one policy.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RankResult {
    pub id: String,
    pub rank: u32,
    pub served: usize,
    pub peak_kv: f64,
    /// Requests sent to the rank while its telemetry was dark, counted from two poll intervals
    /// after it went dark: before then the poll that could see it may not have come back yet.
    pub sent_while_dark: usize,
    /// Requests sent in those first two intervals.
    pub sent_before_detection: usize,
}

/// Results of one policy.
pub struct PolicyRun {
    pub policy: Policy,
    pub report: Report,
    pub ranks: Vec<RankResult>,
    /// (seconds since start, KV usage per rank in fleet order).
    pub kv_series: Vec<(f64, Vec<f64>)>,
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// Starts a fresh fleet and router for `policy`, drives the workload with its events, and tears
/// everything down.
pub async fn run_policy(s: &Scenario, policy: Policy, progress: bool) -> Result<PolicyRun, String> {
    let grpc = s.workload.grpc;
    let mut engines = Vec::new();
    let mut urls = Vec::new();
    for spec in &s.engines {
        let cfg = spec.sim_config();
        let e = SimEngine::start(loopback(), cfg)
            .await
            .map_err(|err| format!("starting simulated engine: {err}"))?;
        urls.push(match grpc {
            true => {
                let g = e.start_grpc(loopback()).await;
                format!(
                    "grpc_url = \"http://{}\"",
                    g.map_err(|err| err.to_string())?
                )
            }
            false => format!("url = \"{}\"", e.url()),
        });
        engines.push(e);
    }
    let mut toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}\
         [routing]\npolicy = \"{}\"\n\
         [telemetry]\ninterval = \"{}ms\"\nstale_after = \"{}ms\"\n",
        if grpc {
            "grpc_listen = \"127.0.0.1:0\"\n"
        } else {
            ""
        },
        policy.as_str(),
        s.router.interval.0.as_millis(),
        s.router.stale_after.0.as_millis()
    );
    for (url, spec) in urls.iter().zip(&s.engines) {
        toml.push_str(&format!(
            "[[engines]]\n{url}\nflavor = \"{}\"\ndp_size = {}\nstart_rank = {}\n",
            spec.flavor.as_str(),
            spec.dp_size,
            spec.start_rank
        ));
    }
    let cfg = Config::from_str(&toml).map_err(|e| e.to_string())?;
    let router = Router::start(cfg).await.map_err(|e| e.to_string())?;
    if progress {
        // Where to watch it while it runs, from another terminal.
        let admin = router.admin_addr;
        eprintln!(
            "  {}: watch it live with `rankgate top --admin http://{admin}` (or `cargo run --release -- top --admin http://{admin}`); metrics at http://{admin}/metrics",
            policy.as_str()
        );
    }
    // Bounded wait for the first telemetry, so every policy starts from what a steady router knows.
    for _ in 0..250 {
        if router
            .selector
            .any_routable(&router.table, &Default::default())
            && router
                .table
                .snapshot
                .load()
                .ranks
                .iter()
                .all(|r| r.reachable)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let engines = Arc::new(engines);
    let ids: Vec<String> = (router.table.snapshot.load().fleet)
        .workers
        .iter()
        .map(|w| w.id_text.to_string())
        .collect();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let sampler = tokio::spawn(sample_kv(engines.clone(), stop_rx.clone()));
    let timeline = tokio::spawn(events::play(engines.clone(), s.events.clone(), stop_rx));

    let w = &s.workload;
    let workload = Workload {
        url: format!("http://{}", router.grpc_addr.unwrap_or(router.addr)),
        api: w.api,
        stream: w.stream,
        arrivals: match (w.rate, w.concurrency) {
            (Some(r), _) => Arrivals::Poisson(r),
            (None, c) => Arrivals::Closed(c.unwrap_or(1)),
        },
        requests: w.requests,
        duration: w.duration.0,
        prompt_tokens: w.prompt_tokens,
        output_tokens: w.output_tokens,
        trace: s.trace.clone(),
        bursts: w.bursts.clone(),
        model: "tiny-llama".into(),
        grpc: grpc.then(|| s.engines[0].flavor.into()),
        progress,
        seed: w.seed,
    };
    let report = load::run(&workload).await;
    let _ = stop_tx.send(true);
    let kv_series = sampler.await.unwrap_or_default();
    let _ = timeline.await;
    router.shutdown().await;
    if let Ok(engines) = Arc::try_unwrap(engines) {
        for e in engines {
            e.shutdown().await;
        }
    }
    let report = report?;

    let per = report.per_worker();
    let windows = s.dark_windows();
    let ranks = s
        .ranks()
        .into_iter()
        .zip(ids)
        .enumerate()
        .map(|(i, (rank, id))| {
            let in_windows = |shift: Duration, to_end: bool| {
                report
                    .outcomes
                    .iter()
                    .filter(|o| o.worker.as_deref() == Some(id.as_str()))
                    .filter(|o| {
                        windows.iter().any(|&(r, from, until)| {
                            let detected = from + shift;
                            r == rank
                                && if to_end {
                                    o.sent >= detected && o.sent < until
                                } else {
                                    o.sent >= from && o.sent < detected.min(until)
                                }
                        })
                    })
                    .count()
            };
            RankResult {
                served: per.get(&id).copied().unwrap_or(0),
                peak_kv: kv_series.iter().map(|(_, kv)| kv[i]).fold(0.0, f64::max),
                sent_while_dark: in_windows(2 * s.router.interval.0, true),
                sent_before_detection: in_windows(2 * s.router.interval.0, false),
                id,
                rank,
            }
        })
        .collect();
    Ok(PolicyRun {
        policy,
        report,
        ranks,
        kv_series,
    })
}

async fn sample_kv(
    engines: Arc<Vec<SimEngine>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<(f64, Vec<f64>)> {
    let start = Instant::now();
    let mut out = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return out,
        }
        let kv: Vec<f64> = engines.iter().flat_map(|e| e.kv_usage()).collect();
        out.push((start.elapsed().as_secs_f64(), kv));
    }
}

/// Runs every policy of the scenario in turn.
pub async fn run(
    s: &Scenario,
    policies: Option<&[Policy]>,
    progress: bool,
) -> Result<Vec<PolicyRun>, String> {
    let mut runs = Vec::new();
    for &p in policies.unwrap_or(&s.policies) {
        if progress {
            eprintln!("scenario {}: policy {} ...", s.name, p.as_str());
        }
        runs.push(run_policy(s, p, progress).await?);
    }
    Ok(runs)
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
        assert_eq!(s.ranks(), [0, 1]);
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
    fn shipped_scenarios_parse() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/scenarios");
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
