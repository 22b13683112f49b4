//! Runs one variant of a scenario: a fresh simulated fleet, one or several rankgate routers in
//! front of it (each with its own polls and nothing shared, as separate processes would be), the
//! workload with its events, per-rank KV sampled every 100 ms, and the fleet's prefix-cache
//! counters and the requests each rank received read from the simulator at the end. A
//! disaggregated fleet's engines are given to the router with their roles; with
//! [`Fleet::Colocated`] the same engines start without them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::router_config::{router_toml, Started};
use super::{events, Scenario, Variant};
use crate::load::{self, Arrivals, Dist, Report, Workload};
use crate::sim::{PdRole, SimConfig, SimEngine};
use rankgate::app::Router;
use rankgate::config::Config;

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
    /// Prompt tokens the rank looked up in its prefix cache, and those it found.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    /// `"prefill"` or `"decode"`; `None`: the rank prefills and decodes its own requests.
    pub role: Option<&'static str>,
    /// Requests the rank's engine received for it (the engine's own record, the last 4096 per
    /// engine): a disaggregated request's prefill leg on a prefill rank, its decode leg on a
    /// decode rank.
    pub legs: usize,
    /// With LoRA: requests the rank set aside for want of a slot (each once), and adapters it
    /// loaded into a slot.
    pub lora_slot_waits: u64,
    pub lora_loads: u64,
}

/// The fleet a run starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fleet {
    /// The scenario's engines as written, roles included.
    AsWritten,
    /// The same engines without their roles: every rank prefills and decodes its own requests.
    Colocated,
}

/// Results of one variant with one replica count.
pub struct PolicyRun {
    pub policy: Variant,
    pub fleet: Fleet,
    /// Whether the fleet was served in two legs (some engine had a role).
    pub disaggregated: bool,
    /// Rankgate routers that shared the load.
    pub replicas: u32,
    /// The load report; its `prefix_cache` is the whole fleet's.
    pub report: Report,
    pub ranks: Vec<RankResult>,
    /// (seconds since start, KV usage per rank in fleet order).
    pub kv_series: Vec<(f64, Vec<f64>)>,
    /// With a timeline: the fleet's prefix-cache (queries, hits) from its last event to the
    /// end of the run.
    pub prefix_after_events: Option<(u64, u64)>,
    /// The requests the engines served, by the model they were sent for (after any route's
    /// rewrite), in name order.
    pub models: Vec<(String, usize)>,
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

impl PolicyRun {
    /// The variant, with the replica count when there were several: `least_kv+affinity x3`.
    pub fn label(&self) -> String {
        let mut l = match self.replicas {
            1 => self.policy.as_str().to_string(),
            n => format!("{} x{n}", self.policy.as_str()),
        };
        if self.disaggregated {
            l.push_str(" (P/D)");
        } else if self.fleet == Fleet::Colocated {
            l.push_str(" (colocated)");
        }
        l
    }
}

/// Starts a fresh fleet and `replicas` routers for `policy`, drives the workload with its events
/// (requests spread over the routers in turn), and tears everything down.
pub async fn run_policy(
    s: &Scenario,
    policy: Variant,
    replicas: u32,
    progress: bool,
) -> Result<PolicyRun, String> {
    run_fleet(s, policy, replicas, progress, Fleet::AsWritten).await
}

/// [`run_policy`] on the scenario's fleet as written or colocated.
pub async fn run_fleet(
    s: &Scenario,
    policy: Variant,
    replicas: u32,
    progress: bool,
    fleet: Fleet,
) -> Result<PolicyRun, String> {
    let grpc = s.workload.grpc;
    let roles: Vec<Option<PdRole>> = (s.engines.iter())
        .map(|e| e.role.filter(|_| fleet == Fleet::AsWritten))
        .collect();
    let mut engines = Vec::new();
    let mut started = Vec::new();
    for (spec, role) in s.engines.iter().zip(&roles) {
        let cfg = SimConfig {
            role: *role,
            ..spec.sim_config()
        };
        let e = SimEngine::start(loopback(), cfg)
            .await
            .map_err(|err| format!("starting simulated engine: {err}"))?;
        let url_line = match grpc {
            true => {
                let g = e.start_grpc(loopback()).await;
                format!(
                    "grpc_url = \"http://{}\"",
                    g.map_err(|err| err.to_string())?
                )
            }
            false => format!("url = \"{}\"", e.url()),
        };
        started.push(Started {
            url_line,
            role: *role,
            bootstrap_port: e.bootstrap_port(),
        });
        engines.push(e);
    }
    let toml = router_toml(s, policy, &started)?;
    let mut routers = Vec::new();
    for _ in 0..replicas.max(1) {
        let cfg = Config::from_str(&toml).map_err(|e| format!("router config: {e}\n{toml}"))?;
        let router = Router::start(cfg).await.map_err(|e| e.to_string())?;
        if progress {
            // Where to watch it while it runs, from another terminal.
            let admin = router.admin_addr;
            eprintln!(
                "  {}: watch it live with `rankgate top --admin http://{admin}` (or `cargo run --release -- top --admin http://{admin}`); metrics at http://{admin}/metrics",
                policy.as_str()
            );
        }
        routers.push(router);
    }
    // Bounded wait for the first telemetry, so every policy starts from what a steady router knows.
    for router in &routers {
        for _ in 0..250 {
            if router
                .selector
                .any_front_routable(&router.table, router.grpc_addr.is_some())
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
    }
    let router = &routers[0];

    let engines = Arc::new(engines);
    let ids: Vec<String> = (router.table.snapshot.load().fleet)
        .workers
        .iter()
        .map(|w| w.id_text.to_string())
        .collect();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let sampler = tokio::spawn(sample_kv(engines.clone(), stop_rx.clone()));
    let timeline = tokio::spawn(events::play(
        engines.clone(),
        s.ranks(),
        s.events.clone(),
        stop_rx,
    ));

    let w = &s.workload;
    let workload = Workload {
        url: format!("http://{}", router.grpc_addr.unwrap_or(router.addr)),
        spread: routers[1..]
            .iter()
            .map(|r| format!("http://{}", r.addr))
            .collect(),
        sessions: w.sessions.clone(),
        hot_prefix: w.hot_prefix,
        api: w.api,
        stream: w.stream,
        arrivals: match (w.rate, w.concurrency) {
            (Some(r), _) => Arrivals::Poisson(r),
            (None, c) => Arrivals::Closed(c.unwrap_or(1)),
        },
        requests: w.requests.unwrap_or(0),
        duration: w.duration.0,
        // Unused by sessions, whose prompts are their own.
        prompt_tokens: w.prompt_tokens.unwrap_or(Dist::Fixed(200)),
        output_tokens: w.output_tokens.unwrap_or(Dist::Fixed(64)),
        trace: s.trace.clone(),
        bursts: w.bursts.clone(),
        model: "tiny-llama".into(),
        models: w.models.clone(),
        model_spread: w.model_spread,
        grpc: grpc.then(|| s.engines[0].flavor.into()),
        progress,
        seed: w.seed,
        // Scenarios run with `expose_worker = "url"`: every answer names its rank.
        admin_token: None,
        headers: Arc::new([]),
    };
    let report = match w.tenants.is_empty() {
        true => load::run(&workload).await,
        false => {
            let tenants = (w.tenants.iter().enumerate())
                .map(|(i, t)| t.tenant(i, w, &workload))
                .collect::<Result<Vec<_>, _>>();
            match tenants {
                Ok(t) => load::run_tenants(&t).await,
                Err(e) => Err(e),
            }
        }
    };
    let _ = stop_tx.send(true);
    let kv_series = sampler.await.unwrap_or_default();
    let at_last_event = timeline.await.ok().flatten();
    for router in routers {
        router.shutdown().await;
    }
    // Each variant starts a fresh fleet, so the counters are this run's alone.
    let prefix: Vec<(u64, u64)> = engines.iter().flat_map(|e| e.prefix_cache()).collect();
    let fleet_ranks = s.ranks();
    let mut models = std::collections::BTreeMap::<String, usize>::new();
    for seen in engines.iter().flat_map(|e| e.seen()) {
        *models.entry(seen.model.unwrap_or_default()).or_default() += 1;
    }
    let legs: Vec<usize> = (fleet_ranks.iter())
        .map(|&(e, r)| engines[e].seen().iter().filter(|x| x.rank == r).count())
        .collect();
    let slots: Vec<(u64, u64)> = (fleet_ranks.iter())
        .map(|&(e, r)| {
            let local = r.saturating_sub(s.engines[e].start_rank) as usize;
            let at = |v: Vec<u64>| v.get(local).copied().unwrap_or(0);
            (
                at(engines[e].lora_slot_waits()),
                at(engines[e].lora_loads()),
            )
        })
        .collect();
    if let Ok(engines) = Arc::try_unwrap(engines) {
        for e in engines {
            e.shutdown().await;
        }
    }
    let mut report = report?;
    report.prefix_cache = Some(prefix.iter().fold((0, 0), |(q, h), &(a, b)| (q + a, h + b)));
    let prefix_after_events = at_last_event
        .zip(report.prefix_cache)
        .map(|((q0, h0), (q, h))| (q.saturating_sub(q0), h.saturating_sub(h0)));

    let per = report.per_worker();
    let windows = s.dark_windows();
    let ranks = (0..s.ranks().len())
        .zip(ids)
        .map(|(i, id)| {
            let in_windows = |shift: Duration, to_end: bool| {
                report
                    .outcomes
                    .iter()
                    .filter(|o| o.worker.as_deref() == Some(id.as_str()))
                    .filter(|o| {
                        windows.iter().any(|&(r, from, until)| {
                            let detected = from + shift;
                            r == i
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
                prefix_queries: prefix.get(i).map_or(0, |p| p.0),
                prefix_hits: prefix.get(i).map_or(0, |p| p.1),
                role: roles[fleet_ranks[i].0].map(role_name),
                legs: legs[i],
                lora_slot_waits: slots[i].0,
                lora_loads: slots[i].1,
                id,
                rank: i as u32,
            }
        })
        .collect();
    Ok(PolicyRun {
        policy,
        fleet,
        disaggregated: roles.iter().any(Option::is_some),
        replicas,
        report,
        ranks,
        kv_series,
        prefix_after_events,
        models: models.into_iter().collect(),
    })
}

pub(super) fn role_name(role: PdRole) -> &'static str {
    match role {
        PdRole::Prefill => "prefill",
        PdRole::Decode => "decode",
    }
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

/// Runs every variant of the scenario (or those given) in turn, each once per replica count.
pub async fn run(
    s: &Scenario,
    policies: Option<&[Variant]>,
    progress: bool,
) -> Result<Vec<PolicyRun>, String> {
    let policies = policies.unwrap_or(&s.policies);
    if let Some(v) = policies.iter().find(|v| v.flow && s.flow.is_none()) {
        return Err(format!(
            "{}: the scenario has no [flow] table to give the router",
            v.as_str()
        ));
    }
    let mut runs = Vec::new();
    for n in s.router.replicas.counts() {
        for &p in policies {
            if progress {
                eprintln!(
                    "scenario {}: policy {}, {n} router(s) ...",
                    s.name,
                    p.as_str()
                );
            }
            runs.push(run_policy(s, p, n, progress).await?);
            if s.also_colocated {
                if progress {
                    eprintln!("  ... and on the same engines colocated");
                }
                runs.push(run_fleet(s, p, n, progress, Fleet::Colocated).await?);
            }
        }
    }
    Ok(runs)
}
