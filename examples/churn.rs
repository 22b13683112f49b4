//! A fleet that changes under load: simulated engines join and leave through rankgate's admin
//! API every few seconds while the load client streams chat completions through it. Every
//! engine is removed while streams are running on it. Prints the load report, what was changed
//! and how many streams each removal left running, and the failures (the goal: none).
//!
//!   cargo run --release --example churn -- --duration 60s --rate 40 --every 2s
//!
//! Loopback only; the run is bounded by `--duration` (and the load's own request cap).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use rankgate::app::Router;
use rankgate::config::{parse_duration, Config};
use rankgate_sim::load::{Arrivals, Dist, Workload};
use rankgate_sim::sim::{SimConfig, SimEngine};
use serde_json::json;
use tokio::time::Instant;

/// Simulated engines, two DP ranks each; two start in the fleet.
const ENGINES: usize = 4;
const TOKEN: &str = "churn-admin-token";

#[derive(Parser)]
#[command(about = "Engines join and leave rankgate's fleet every few seconds under streaming load")]
struct Args {
    /// How long the load runs.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    duration: Duration,
    /// Requests per second (Poisson arrivals).
    #[arg(long, default_value_t = 40.0)]
    rate: f64,
    /// Time between membership changes (an engine joins, then the oldest leaves).
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    every: Duration,
    /// Output tokens per request (at 100 tokens/s per request, streams last about this many
    /// hundredths of a second).
    #[arg(long, default_value_t = 100)]
    tokens: u64,
}

type HttpClient = rankgate::http::HttpClient<Full<Bytes>>;

async fn admin(
    client: &HttpClient,
    addr: SocketAddr,
    method: Method,
    path: &str,
    body: Option<serde_json::Value>,
) -> Result<String, String> {
    let req = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Full::new(
            body.map_or(Bytes::new(), |b| b.to_string().into()),
        ))
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&body.to_bytes()).into_owned();
    if status.is_success() {
        Ok(text)
    } else {
        Err(format!("{status}: {text}"))
    }
}

fn main() -> Result<(), String> {
    let args = Args::parse();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?
        .block_on(run(args))
}

async fn run(args: Args) -> Result<(), String> {
    let mut engines = Vec::new();
    for i in 0..ENGINES {
        let cfg = SimConfig {
            dp_size: 2,
            start_rank: 2 * i as u32,
            decode_tokens_per_sec: 100.0,
            capacity_tokens: 200_000,
            ..SimConfig::default()
        };
        let e = SimEngine::start(SocketAddr::from(([127, 0, 0, 1], 0)), cfg)
            .await
            .map_err(|e| e.to_string())?;
        engines.push(e);
    }
    let var = "RANKGATE_CHURN_ADMIN_TOKEN";
    std::env::set_var(var, TOKEN);
    let entry = |i: usize| {
        format!(
            "[[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\ndp_size = 2\nstart_rank = {}\n",
            engines[i].url(),
            2 * i
        )
    };
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nadmin_token_env = \"{var}\"\n\
         [telemetry]\ninterval = \"250ms\"\n{}{}",
        entry(0),
        entry(1)
    );
    let cfg = Config::from_str(&text).map_err(|e| e.to_string())?;
    let router = Router::start(cfg).await.map_err(|e| e.to_string())?;
    let client: HttpClient = rankgate::http::client(Duration::from_secs(2));
    // Ready: some rank polled.
    let ready_by = Instant::now() + Duration::from_secs(10);
    while admin(&client, router.admin_addr, Method::GET, "/ready", None)
        .await
        .is_err()
    {
        if Instant::now() > ready_by {
            return Err("rankgate never became ready".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let mut w = Workload::new(format!("http://{}", router.addr));
    w.stream = true;
    w.arrivals = Arrivals::Poisson(args.rate);
    // As many requests as the rate sends in `duration`, and time for the last to finish: the
    // load client cuts off whatever still runs at its deadline, which would be no fault of the
    // fleet's.
    w.requests = (args.rate * args.duration.as_secs_f64()) as usize;
    w.duration = args.duration + Duration::from_secs(30);
    w.prompt_tokens = Dist::Fixed(100);
    w.output_tokens = Dist::Fixed(args.tokens);
    let load = tokio::spawn(async move { rankgate_sim::load::run(&w).await });

    // The fleet: engines 0 and 1. Each step one engine joins; half a period later the one that
    // has been in longest leaves, with streams running on it.
    let start = Instant::now();
    let mut members: std::collections::VecDeque<usize> = [0, 1].into();
    let mut next = 2;
    let mut changes = Vec::new();
    let mut failed_changes = Vec::new();
    let mut streams_at_removal = Vec::new();
    // Per engine: requests it had received when it left the fleet (checked when it rejoins and
    // at the end: nothing new may reach an engine while it is out).
    let mut left_with: Vec<Option<u64>> = vec![None; ENGINES];
    let mut while_out = 0u64;
    let mut tick = tokio::time::interval_at(start + args.every, args.every);
    while start.elapsed() + args.every < args.duration {
        tick.tick().await;
        let join = next % ENGINES;
        next += 1;
        if members.contains(&join) {
            continue;
        }
        let body = json!({"url": engines[join].url(), "flavor": "vllm", "dp_size": 2, "start_rank": 2 * join});
        match admin(
            &client,
            router.admin_addr,
            Method::POST,
            "/engines",
            Some(body),
        )
        .await
        {
            Ok(_) => {
                if let Some(n) = left_with[join].take() {
                    while_out += engines[join].requests_received() - n;
                }
                members.push_back(join);
                changes.push(format!("{:.1}s +{join}", start.elapsed().as_secs_f64()));
            }
            Err(e) => failed_changes.push(format!("add {join}: {e}")),
        }
        tokio::time::sleep(args.every / 2).await;
        let Some(leave) = members.pop_front() else {
            continue;
        };
        let open = engines[leave].open_requests();
        let path = format!("/engines?url={}", engines[leave].url());
        match admin(&client, router.admin_addr, Method::DELETE, &path, None).await {
            Ok(_) => {
                left_with[leave] = Some(engines[leave].requests_received());
                streams_at_removal.push(open);
                changes.push(format!("{:.1}s -{leave}", start.elapsed().as_secs_f64()));
            }
            Err(e) => {
                members.push_front(leave);
                failed_changes.push(format!("remove {leave}: {e}"));
            }
        }
    }
    let report = load
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("load: {e}"))?;

    println!(
        "## Churn: {ENGINES} simulated engines x 2 DP ranks, one joins and one leaves every {:?}\n",
        args.every
    );
    print!("{}", report.table());
    let failed: Vec<_> = report
        .outcomes
        .iter()
        .filter(|o| o.error.is_some())
        .collect();
    let mut per_engine = vec![0u64; ENGINES];
    for o in report.ok() {
        if let Some(w) = &o.worker {
            if let Some(i) = engines.iter().position(|e| w.starts_with(&e.url())) {
                per_engine[i] += 1;
            }
        }
    }
    println!();
    println!("| | |");
    println!("|---|---|");
    println!(
        "| membership changes | {} ({} joins, {} removals) |",
        changes.len(),
        changes.iter().filter(|c| c.contains('+')).count(),
        streams_at_removal.len()
    );
    println!("| refused changes | {} |", failed_changes.len());
    println!(
        "| streams running on an engine as it was removed | {} in all (per removal: {:?}) |",
        streams_at_removal.iter().sum::<u64>(),
        streams_at_removal
    );
    for (i, n) in left_with.iter().enumerate() {
        if let Some(n) = n {
            while_out += engines[i].requests_received() - n;
        }
    }
    println!("| requests that reached an engine while it was out of the fleet | {while_out} |");
    println!("| requests completed | {} |", report.ok().count());
    println!("| requests failed | {} |", failed.len());
    println!("| completed per engine | {per_engine:?} |");
    let open_end: u64 = engines.iter().map(SimEngine::open_requests).sum();
    println!("| requests still open on engines at the end | {open_end} |");
    println!("\nchanges: {}", changes.join(", "));
    for f in &failed_changes {
        println!("refused: {f}");
    }
    for o in failed.iter().take(10) {
        println!(
            "failed: at {:.2}s status {} {:?} worker {:?}",
            o.sent.as_secs_f64(),
            o.status,
            o.error,
            o.worker
        );
    }
    router.shutdown().await;
    for e in engines {
        e.shutdown().await;
    }
    if failed.is_empty() && failed_changes.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} failed requests, {} refused changes",
            failed.len(),
            failed_changes.len()
        ))
    }
}
