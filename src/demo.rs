//! `rankgate demo`: simulated engines, the router and a bounded load run, once per policy, with
//! the per-rank outcome printed side by side.
//!
//! The fleet is two engines of two ranks each. Rank 0 is already 85% full with someone else's
//! work, so requests sent there queue for KV; rank 3 publishes no telemetry at all. A router that
//! reads per-rank KV keeps traffic off rank 0 and never sends anything to the rank it knows
//! nothing about; a round-robin router gives each rank a quarter of the traffic.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::app::Router;
use crate::config::{Config, Policy};
use crate::load::{percentile, LoadSpec, Report};
use crate::sim::SimFlavor;
use crate::sim::{SimConfig, SimEngine};

/// Knobs of one demo run.
#[derive(Debug, Clone)]
pub struct DemoSpec {
    pub requests: usize,
    pub rate: f64,
    pub policies: Vec<Policy>,
}

impl Default for DemoSpec {
    fn default() -> Self {
        DemoSpec {
            requests: 400,
            rate: 24.0,
            policies: vec![Policy::LeastKv, Policy::RoundRobin],
        }
    }
}

/// Per-rank results of one policy's run.
pub struct PolicyRun {
    pub policy: Policy,
    pub report: Report,
    /// Per worker in fleet order: its id and the peak real KV usage seen on it during the run.
    pub peak_kv: Vec<(String, f64)>,
}

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// Starts a fresh fleet and router, drives the load, and tears everything down.
pub async fn run_policy(policy: Policy, spec: &DemoSpec) -> Result<PolicyRun, String> {
    let base = SimConfig {
        flavor: SimFlavor::Vllm,
        dp_size: 2,
        capacity_tokens: 4096,
        decode_tokens_per_sec: 100.0,
        ..SimConfig::default()
    };
    let a = SimEngine::start(
        loopback(),
        SimConfig {
            preload: vec![0.85, 0.0],
            ..base.clone()
        },
    )
    .await
    .map_err(|e| format!("starting simulated engine: {e}"))?;
    let b = SimEngine::start(
        loopback(),
        SimConfig {
            start_rank: 2,
            dark_ranks: vec![3],
            ..base
        },
    )
    .await
    .map_err(|e| format!("starting simulated engine: {e}"))?;
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [routing]\npolicy = \"{}\"\n[telemetry]\ninterval = \"100ms\"\nstale_after = \"1s\"\n\
         [[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\ndp_size = 2\n\
         [[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\ndp_size = 2\nstart_rank = 2\n",
        policy.as_str(),
        a.url(),
        b.url()
    );
    let cfg = Config::from_str(&toml).map_err(|e| e.to_string())?;
    let router = Router::start(cfg).await.map_err(|e| e.to_string())?;
    // Wait (bounded) for the first telemetry so the run starts from what a steady router knows.
    for _ in 0..100 {
        if router.selector.any_routable(&router.table) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let engines = Arc::new([a, b]);
    let ids: Vec<String> = router
        .table
        .fleet
        .workers
        .iter()
        .map(|w| w.id_text.to_string())
        .collect();
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let sampler = {
        let engines = engines.clone();
        tokio::spawn(async move {
            let mut peak = [0.0f64; 4];
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop_rx.changed() => return peak,
                }
                let kv: Vec<f64> = engines.iter().flat_map(|e| e.kv_usage()).collect();
                for (p, k) in peak.iter_mut().zip(kv) {
                    *p = p.max(k);
                }
            }
        })
    };
    let load = LoadSpec {
        url: format!("http://{}", router.addr),
        requests: spec.requests,
        rate: Some(spec.rate),
        concurrency: 0,
        max_duration: Duration::from_secs(40),
        prompt_chars: 800,
        max_tokens: 64,
        stream: true,
        progress: true,
    };
    let report = crate::load::run(&load).await;
    let _ = stop_tx.send(true);
    let peak = sampler.await.unwrap_or_default();
    router.shutdown().await;
    if let Ok(engines) = Arc::try_unwrap(engines) {
        for e in engines {
            e.shutdown().await;
        }
    }
    Ok(PolicyRun {
        policy,
        report: report?,
        peak_kv: ids.into_iter().zip(peak).collect(),
    })
}

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| format!("{:.0}", d.as_secs_f64() * 1000.0))
}

/// Renders the side-by-side table.
pub fn render(runs: &[PolicyRun]) -> String {
    let mut o = String::new();
    for run in runs {
        let r = &run.report;
        o.push_str(&format!(
            "\npolicy {}: {} ok, {} errors in {:.1} s (arrivals {:.1}/s)\n",
            run.policy.as_str(),
            r.ok().count(),
            r.errors(),
            r.elapsed.as_secs_f64(),
            r.achieved_rate
        ));
        o.push_str(&format!(
            "  {:<28} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9}\n",
            "worker", "served", "peak KV", "TTFT p50", "TTFT p99", "E2E p50", "E2E p99"
        ));
        let per = r.per_worker();
        for (id, peak) in &run.peak_kv {
            let ttft = r.sorted(Some(id), true);
            let e2e = r.sorted(Some(id), false);
            o.push_str(&format!(
                "  {:<28} {:>8} {:>7.0}% {:>9} {:>9} {:>9} {:>9}\n",
                id,
                per.get(id).copied().unwrap_or(0),
                peak * 100.0,
                ms(percentile(&ttft, 50.0)),
                ms(percentile(&ttft, 99.0)),
                ms(percentile(&e2e, 50.0)),
                ms(percentile(&e2e, 99.0)),
            ));
        }
        let ttft = r.sorted(None, true);
        let e2e = r.sorted(None, false);
        o.push_str(&format!(
            "  {:<28} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9}\n",
            "all",
            r.ok().count(),
            "",
            ms(percentile(&ttft, 50.0)),
            ms(percentile(&ttft, 99.0)),
            ms(percentile(&e2e, 50.0)),
            ms(percentile(&e2e, 99.0)),
        ));
    }
    o.push_str("\n(times in ms; TTFT = first streamed chunk; rank @0 starts 85% full, rank @3 publishes no telemetry)\n");
    if let [a, b, ..] = runs {
        let p = |r: &PolicyRun| percentile(&r.report.sorted(None, true), 99.0);
        if let (Some(x), Some(y)) = (p(a), p(b)) {
            o.push_str(&format!(
                "TTFT p99: {} {:.0} ms vs {} {:.0} ms ({:.1}x)\n",
                a.policy.as_str(),
                x.as_secs_f64() * 1000.0,
                b.policy.as_str(),
                y.as_secs_f64() * 1000.0,
                y.as_secs_f64() / x.as_secs_f64().max(1e-9)
            ));
        }
    }
    o
}

/// Runs every policy in turn and prints the comparison.
pub async fn run(spec: DemoSpec) -> Result<(), String> {
    println!(
        "rankgate demo: 2 simulated vLLM engines x 2 DP ranks; {} streaming requests at {}/s per policy",
        spec.requests, spec.rate
    );
    let mut runs = Vec::new();
    for policy in &spec.policies {
        println!("\nrunning policy {} ...", policy.as_str());
        runs.push(run_policy(*policy, &spec).await?);
    }
    print!("{}", render(&runs));
    Ok(())
}
