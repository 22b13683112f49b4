//! `rankgate load`: the load client, and the scenario runner behind `docs/routing-quality.md`.
//!
//! Against any OpenAI-compatible URL:
//!   rankgate load --url http://127.0.0.1:8080 --rate 20 --requests 500 \
//!       [--concurrency 16] [--api chat|completions] [--no-stream] [--prompt-tokens normal:200:50] \
//!       [--output-tokens uniform:32:96] [--trace trace.jsonl] [--duration 60s] [--json report.json] \
//!       [--admin http://127.0.0.1:9090]   # every rank in the per-worker table, 0 included
//!       [--header "x-gateway-inference-fairness-id: team-a"]   # with every request (repeatable)
//!       [--model sql-lora,chat-lora [--model-spread even|random]]   # requests spread over models
//! Multi-turn chat sessions (a shared system prompt per group, growing history), a hot shared
//! prefix, several router replicas (comma-separated --url, requests spread over them in turn), and
//! the engines' prefix-cache hit ratio from their /metrics before and after the run:
//!   rankgate load --url http://127.0.0.1:8080,http://127.0.0.1:8081 \
//!       --sessions 32 --turns 6 --system-tokens 1500 [--system-prompts 4] [--user-tokens 80] \
//!       [--think-time 1s] [--rate 2 | --concurrency 8] --requests 192 \
//!       [--engine-metrics http://127.0.0.1:18001,http://127.0.0.1:18002]
//!   ... --hot-prefix-share 0.5 --hot-prefix-tokens 2000
//! Over gRPC (streaming `Generate` on an engine's gRPC service, or through rankgate's gRPC front
//! door, whose `x-rankgate-worker` metadata gives the per-worker counts):
//!   rankgate load --grpc vllm --url http://127.0.0.1:18051 --rate 20
//! A whole scenario (simulated fleet + router + workload, once per policy):
//!   rankgate load --scenario configs/scenarios/hot-rank.toml \
//!       [--policies least_kv,least_kv+affinity,round_robin] [--json out.json] [--svg out.svg] \
//!       [--markdown out.md]

use std::path::PathBuf;

use rankgate::config::parse_duration;
use rankgate::worker::Flavor;

use super::ToolResult;
use crate::load::{self, Api, Arrivals, Dist, HotPrefix, Sessions, Workload};
use crate::scenario::{self, render, Scenario, Variant};

/// Writes one output file the command line asked for, naming the flag on failure.
fn write(flag: &str, path: &std::path::Path, text: String) -> ToolResult {
    std::fs::write(path, text).map_err(|e| format!("{flag} {}: {e}", path.display()))
}

/// JSON for `--json`, pretty-printed.
fn pretty(v: &serde_json::Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Target base URL; several, comma separated, get the requests in turn (router replicas).
    #[arg(long, conflicts_with = "scenario", value_delimiter = ',')]
    pub url: Vec<String>,
    /// Run a scenario file instead.
    #[arg(long)]
    pub scenario: Option<PathBuf>,
    /// Scenario variants to compare, comma separated, e.g. least_kv,least_kv+affinity (default:
    /// the file's).
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<Variant>,
    /// Open loop: mean arrivals per second (Poisson).
    #[arg(long, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Closed loop: concurrent users.
    #[arg(long)]
    pub concurrency: Option<usize>,
    #[arg(long, default_value_t = 100)]
    pub requests: usize,
    /// Hard cap on the run, e.g. 60s.
    #[arg(long, default_value = "60s")]
    pub duration: String,
    #[arg(long, default_value = "chat")]
    pub api: String,
    /// Call `Generate` on this flavor's gRPC service at --url (vllm or sglang) instead of HTTP.
    #[arg(long)]
    pub grpc: Option<String>,
    #[arg(long)]
    pub no_stream: bool,
    #[arg(long, default_value = "200")]
    pub prompt_tokens: Dist,
    #[arg(long, default_value = "64")]
    pub output_tokens: Dist,
    /// JSONL trace: {"prompt_tokens": N, "output_tokens": M, "at_ms": T?} per line.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// The model requests name; several, comma-separated (LoRA adapters served as models),
    /// spread as --model-spread says.
    #[arg(long, value_delimiter = ',', default_value = "tiny-llama")]
    pub model: Vec<String>,
    /// How requests are spread over several --model names: in turn (even) or drawn (random).
    #[arg(long, value_enum, default_value = "even")]
    pub model_spread: load::ModelSpread,
    /// Multi-turn chat sessions: how many (needs --turns).
    #[arg(long, requires = "turns")]
    pub sessions: Option<usize>,
    /// Turns per session.
    #[arg(long, requires = "sessions")]
    pub turns: Option<usize>,
    /// Sessions: system prompt length.
    #[arg(long, default_value_t = 1000)]
    pub system_tokens: u64,
    /// Sessions: distinct system prompts, each shared by a group of sessions.
    #[arg(long, default_value_t = 1)]
    pub system_prompts: usize,
    /// Sessions: length of each new user message.
    #[arg(long, default_value = "60")]
    pub user_tokens: Dist,
    /// Sessions: mean think time between an answer and the next turn (exponential), e.g. 1s.
    #[arg(long, default_value = "0s")]
    pub think_time: String,
    /// Share of requests (0, 1] starting with one shared prefix (needs --hot-prefix-tokens).
    #[arg(long, requires = "hot_prefix_tokens")]
    pub hot_prefix_share: Option<f64>,
    /// Length of that shared prefix.
    #[arg(long, requires = "hot_prefix_share")]
    pub hot_prefix_tokens: Option<u64>,
    /// Engine base URLs whose vllm:prefix_cache_* counters are read before and after the run,
    /// for the prefix-hit ratio (comma separated).
    #[arg(long, value_delimiter = ',')]
    pub engine_metrics: Vec<String>,
    /// The router's admin listener (base URL): the report then lists every rank of its fleet,
    /// those that served nothing included.
    #[arg(long, conflicts_with = "scenario")]
    pub admin: Option<String>,
    /// rankgate's admin token (else RANKGATE_ADMIN_TOKEN): each request asks which rank served
    /// it, so the per-worker counts are right under any `server.expose_worker`.
    #[arg(long)]
    pub admin_token: Option<String>,
    /// `name: value`, sent with every request (repeatable): e.g. a tenant's
    /// `x-gateway-inference-fairness-id` or `x-gateway-inference-objective`.
    #[arg(long = "header", conflicts_with = "scenario")]
    pub headers: Vec<String>,
    /// Write the full report as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Scenario only: write the per-rank KV chart.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Scenario only: write the Markdown tables.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
}

/// A scenario (`--scenario`) or a workload against `--url`: runs it, prints the report and
/// writes the files asked for.
pub async fn run(a: Args) -> ToolResult {
    if let Some(path) = &a.scenario {
        let s = Scenario::load(path)?;
        let policies = a.policies;
        let started = std::time::Instant::now();
        let runs = scenario::run(&s, (!policies.is_empty()).then_some(&policies[..]), true).await?;
        let md = render::markdown(&s, &runs);
        println!(
            "## {}\n\n{}\n{md}\n(whole scenario: {:.0} s)",
            s.name,
            s.description,
            started.elapsed().as_secs_f64()
        );
        if let Some(p) = &a.json {
            write("--json", p, pretty(&render::to_json(&s, &runs)))?;
        }
        if let Some(p) = &a.svg {
            write("--svg", p, render::svg(&s, &runs))?;
        }
        if let Some(p) = &a.markdown {
            write("--markdown", p, md)?;
        }
        return Ok(());
    }
    let mut urls = a.url.into_iter();
    let Some(url) = urls.next() else {
        return Err("give --url or --scenario".into());
    };
    let mut w = Workload::new(url);
    w.spread = urls.collect();
    w.api = match a.api.as_str() {
        "chat" => Api::Chat,
        "completions" => Api::Completions,
        other => return Err(format!("--api {other:?}: chat or completions")),
    };
    w.stream = !a.no_stream;
    w.grpc = match a.grpc.as_deref() {
        None => None,
        Some("vllm") => Some(Flavor::Vllm),
        Some("sglang") => Some(Flavor::Sglang),
        Some(other) => return Err(format!("--grpc {other:?}: vllm or sglang")),
    };
    w.arrivals = match (a.rate, a.concurrency) {
        (Some(r), _) if r > 0.0 => Arrivals::Poisson(r),
        (None, Some(c)) if c > 0 => Arrivals::Closed(c),
        (None, None) => Arrivals::Poisson(10.0),
        _ => return Err("--rate and --concurrency must be positive".into()),
    };
    w.requests = a.requests;
    w.duration = parse_duration(&a.duration).map_err(|e| format!("--duration: {e}"))?;
    w.prompt_tokens = a.prompt_tokens;
    w.output_tokens = a.output_tokens;
    load::check_models(&a.model).map_err(|e| format!("--model: {e}"))?;
    w.model = a
        .model
        .first()
        .cloned()
        .unwrap_or_else(|| "tiny-llama".into());
    if a.model.len() > 1 {
        w.models = a.model;
    }
    w.model_spread = a.model_spread;
    w.progress = true;
    w.headers = (a.headers.iter())
        .map(|h| header(h).map_err(|e| format!("--header {h:?}: {e}")))
        .collect::<Result<Vec<_>, _>>()?
        .into();
    let token = super::admin_token(a.admin_token);
    w.admin_token = token.as_deref().map(Into::into);
    if let (Some(count), Some(turns)) = (a.sessions, a.turns) {
        let s = Sessions {
            count,
            turns,
            system_tokens: a.system_tokens,
            system_prompts: a.system_prompts,
            user_tokens: a.user_tokens,
            think_time: parse_duration(&a.think_time).map_err(|e| format!("--think-time: {e}"))?,
        };
        s.validate()
            .map_err(|e| format!("--sessions/--turns/--system-prompts: {e}"))?;
        w.sessions = Some(s);
    }
    if let (Some(share), Some(tokens)) = (a.hot_prefix_share, a.hot_prefix_tokens) {
        let h = HotPrefix { share, tokens };
        h.validate()
            .map_err(|e| format!("--hot-prefix-share/--hot-prefix-tokens: {e}"))?;
        w.hot_prefix = Some(h);
    }
    if let Some(t) = &a.trace {
        let text =
            std::fs::read_to_string(t).map_err(|e| format!("--trace {}: {e}", t.display()))?;
        w.trace = Some(load::dist::read_trace(&text).map_err(|e| format!("--trace: {e}"))?);
    }
    let before = match a.engine_metrics.is_empty() {
        true => None,
        false => Some(
            load::scrape::scrape(&a.engine_metrics)
                .await
                .map_err(|e| format!("--engine-metrics: {e}"))?,
        ),
    };
    let mut report = load::run(&w).await?;
    if let Some((q0, h0)) = before {
        let (q1, h1) = load::scrape::scrape(&a.engine_metrics)
            .await
            .map_err(|e| format!("--engine-metrics: {e}"))?;
        report.prefix_cache = Some((q1.saturating_sub(q0), h1.saturating_sub(h0)));
    }
    if let Some(admin) = &a.admin {
        report.fleet = load::fleet::ranks(admin, token.as_deref())
            .await
            .map_err(|e| format!("--admin: {e}"))?;
    }
    print!("{}", report.table());
    if let Some(p) = &a.json {
        write("--json", p, pretty(&report.to_json()))?;
    }
    Ok(())
}

/// `name: value` as a header.
fn header(text: &str) -> Result<(http::HeaderName, http::HeaderValue), String> {
    let (name, value) = text.split_once(':').ok_or("write it as `name: value`")?;
    let name = http::HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|_| format!("{:?} is not a header name", name.trim()))?;
    let value = http::HeaderValue::from_str(value.trim())
        .map_err(|_| format!("{:?} is not a header value", value.trim()))?;
    Ok((name, value))
}

#[cfg(test)]
mod tests {
    #[test]
    fn header_flags_are_name_colon_value() {
        let (n, v) = super::header("x-gateway-inference-objective: batch ").unwrap();
        assert_eq!(
            (n.as_str(), v.to_str().unwrap()),
            ("x-gateway-inference-objective", "batch")
        );
        assert!(super::header("no colon")
            .unwrap_err()
            .contains("name: value"));
        assert!(super::header("bad name: x")
            .unwrap_err()
            .contains("bad name"));
    }
}
