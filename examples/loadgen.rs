//! The load client, and the scenario runner behind `docs/routing-quality.md`.
//!
//! Against any OpenAI-compatible URL:
//!   cargo run --release --example loadgen -- --url http://127.0.0.1:8080 --rate 20 --requests 500 \
//!       [--concurrency 16] [--api chat|completions] [--no-stream] [--prompt-tokens normal:200:50] \
//!       [--output-tokens uniform:32:96] [--trace trace.jsonl] [--duration 60s] [--json report.json]
//! Over gRPC (streaming `Generate` on an engine's gRPC service, or through rankgate's gRPC front
//! door, whose `x-rankgate-worker` metadata gives the per-worker counts):
//!   cargo run --release --example loadgen -- --grpc vllm --url http://127.0.0.1:50051 --rate 20
//! A whole scenario (simulated fleet + router + workload, once per policy):
//!   cargo run --release --example loadgen -- --scenario configs/scenarios/hot-rank.toml \
//!       [--policies least_kv,round_robin] [--json out.json] [--svg out.svg] [--markdown out.md]

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Parser;
use rankgate::config::{parse_duration, Policy};
use rankgate::load::{self, Api, Arrivals, Dist, Workload};
use rankgate::scenario::{self, render, Scenario};
use rankgate::worker::Flavor;

#[derive(Parser)]
#[command(
    about = "OpenAI load client with TTFT / ITL / E2E percentiles, and routing-quality scenarios"
)]
struct Args {
    /// Target base URL.
    #[arg(long, conflicts_with = "scenario")]
    url: Option<String>,
    /// Run a scenario file instead.
    #[arg(long)]
    scenario: Option<PathBuf>,
    /// Scenario policies to compare, comma separated (default: the file's).
    #[arg(long, value_delimiter = ',')]
    policies: Vec<String>,
    /// Open loop: mean arrivals per second (Poisson).
    #[arg(long, conflicts_with = "concurrency")]
    rate: Option<f64>,
    /// Closed loop: concurrent users.
    #[arg(long)]
    concurrency: Option<usize>,
    #[arg(long, default_value_t = 100)]
    requests: usize,
    /// Hard cap on the run, e.g. 60s.
    #[arg(long, default_value = "60s")]
    duration: String,
    #[arg(long, default_value = "chat")]
    api: String,
    /// Call `Generate` on this flavor's gRPC service at --url (vllm or sglang) instead of HTTP.
    #[arg(long)]
    grpc: Option<String>,
    #[arg(long)]
    no_stream: bool,
    #[arg(long, default_value = "200")]
    prompt_tokens: Dist,
    #[arg(long, default_value = "64")]
    output_tokens: Dist,
    /// JSONL trace: {"prompt_tokens": N, "output_tokens": M, "at_ms": T?} per line.
    #[arg(long)]
    trace: Option<PathBuf>,
    #[arg(long, default_value = "tiny-llama")]
    model: String,
    /// Write the full report as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Scenario only: write the per-rank KV chart.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Scenario only: write the Markdown tables.
    #[arg(long)]
    markdown: Option<PathBuf>,
}

fn policy(s: &str) -> anyhow::Result<Policy> {
    Ok(match s {
        "least_kv" => Policy::LeastKv,
        "round_robin" => Policy::RoundRobin,
        "random" => Policy::Random,
        other => bail!("unknown policy {other:?}: least_kv, round_robin or random"),
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    if let Some(path) = &a.scenario {
        let s = Scenario::load(path).map_err(anyhow::Error::msg)?;
        let policies = a
            .policies
            .iter()
            .map(|p| policy(p))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let started = std::time::Instant::now();
        let runs = scenario::run(&s, (!policies.is_empty()).then_some(&policies[..]), true)
            .await
            .map_err(anyhow::Error::msg)?;
        let md = render::markdown(&s, &runs);
        println!(
            "## {}\n\n{}\n{md}\n(whole scenario: {:.0} s)",
            s.name,
            s.description,
            started.elapsed().as_secs_f64()
        );
        if let Some(p) = &a.json {
            std::fs::write(
                p,
                serde_json::to_string_pretty(&render::to_json(&s, &runs))?,
            )
            .context("writing --json")?;
        }
        if let Some(p) = &a.svg {
            std::fs::write(p, render::svg(&s, &runs)).context("writing --svg")?;
        }
        if let Some(p) = &a.markdown {
            std::fs::write(p, md).context("writing --markdown")?;
        }
        return Ok(());
    }
    let Some(url) = a.url else {
        bail!("give --url or --scenario")
    };
    let mut w = Workload::new(url);
    w.api = match a.api.as_str() {
        "chat" => Api::Chat,
        "completions" => Api::Completions,
        other => bail!("--api {other:?}: chat or completions"),
    };
    w.stream = !a.no_stream;
    w.grpc = match a.grpc.as_deref() {
        None => None,
        Some("vllm") => Some(Flavor::Vllm),
        Some("sglang") => Some(Flavor::Sglang),
        Some(other) => bail!("--grpc {other:?}: vllm or sglang"),
    };
    w.arrivals = match (a.rate, a.concurrency) {
        (Some(r), _) if r > 0.0 => Arrivals::Poisson(r),
        (None, Some(c)) if c > 0 => Arrivals::Closed(c),
        (None, None) => Arrivals::Poisson(10.0),
        _ => bail!("--rate and --concurrency must be positive"),
    };
    w.requests = a.requests;
    w.duration = parse_duration(&a.duration).map_err(anyhow::Error::msg)?;
    w.prompt_tokens = a.prompt_tokens;
    w.output_tokens = a.output_tokens;
    w.model = a.model;
    w.progress = true;
    if let Some(t) = &a.trace {
        let text =
            std::fs::read_to_string(t).with_context(|| format!("reading {}", t.display()))?;
        w.trace = Some(load::dist::read_trace(&text).map_err(anyhow::Error::msg)?);
    }
    let report = load::run(&w).await.map_err(anyhow::Error::msg)?;
    print!("{}", report.table());
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&report.to_json())?)
            .context("writing --json")?;
    }
    Ok(())
}
