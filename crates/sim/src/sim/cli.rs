//! `rankgate mock-engine`: a simulated vLLM or SGLang engine hosting N DP ranks, as a standalone
//! server, built with the router (feature `sim`), so the README's walkthrough needs no other
//! build.
//!
//!   rankgate mock-engine --listen 127.0.0.1:18001 --flavor vllm --dp-size 2 \
//!     [--start-rank S] [--kv-usage 0.1,0.8] [--preload 0.9,0] [--dark-ranks 1] [--garbage-ranks 0] \
//!     [--grpc-listen 127.0.0.1:18051] [--servicer-quirks] [--model a,b] [--api-key K] \
//!     [--capacity-tokens 440912] [--decode-rate 160] [--prefill-rate 30000]
//!     [--prefill-interference] [--prefix-caching] [--tokenizer DIR]
//!     [--max-num-seqs 1024] [--scheduling-policy fcfs|priority]
//!     [--enable-lora [--max-loras 1] [--max-lora-rank 16] [--lora-modules a=PATH b=ORG/ID ...]
//!      [--allow-runtime-lora] [--lora-load-ms 25]]
//!     [--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}']
//!     [--tls-cert c.pem --tls-key k.pem [--tls-client-ca ca.pem]]
//!
//! Faults, to watch a router cope: [--fail-status 503 --fail-percent 100] [--fail-first N] [--hang-requests]
//! [--hang-metrics] [--hang-models] [--health-status 503] [--die-after N] [--stall-after-tokens K].
//! With `--die-after` the process exits (status 1) once the engine has died.
//!
//! Unlike [`SimConfig::default`], a rank starts as big and as fast as a real one
//! ([`super::deployment`]: Llama-3.1-8B on one 80 GB GPU under vLLM), so a conversation on an
//! idle fleet is a sliver of its rank, as it would be in production.
//!
//! Every proxied answer (generation, pooling, tokenizer, audio, SGLang's native endpoints) carries
//! `x-sim-rank: <global rank>`, the rank that served it.
//!
//! Prefill/decode disaggregation (see `pd`): `--role prefill|decode` (none: colocated).
//! vLLM: [--engine-id ID] [--kv-lease 30] [--side-port BASE] (P's side channel of rank r on
//! BASE + r; 0 or absent: free ports). SGLang: [--disaggregation-bootstrap-port PORT] on P,
//! [--disaggregation-bootstrap-timeout 300] (P) and [--disaggregation-waiting-timeout 300] (D).

use std::net::SocketAddr;

use clap::ValueEnum;

use super::{check_percent, check_status, deployment, SimConfig, SimEngine, SimFlavor as Flavor};
use rankgate::worker::RankNumbering;

#[derive(Clone, Copy, ValueEnum)]
pub enum FlavorArg {
    Vllm,
    Sglang,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum RoleArg {
    Prefill,
    Decode,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum Numbering {
    Global,
    Local,
}

/// `rankgate mock-engine`'s flags.
#[derive(clap::Args)]
#[command(after_long_help = deployment::help())]
pub struct Args {
    #[arg(long)]
    listen: SocketAddr,
    /// Also serve GetLoads / GetServerInfo / grpc.health.v1 here (h2c).
    #[arg(long)]
    grpc_listen: Option<SocketAddr>,
    /// Imitate smg-grpc-servicer 0.14.1: ignore the dp_rank filter, report summed capacity.
    #[arg(long)]
    servicer_quirks: bool,
    #[arg(long, value_enum)]
    flavor: FlavorArg,
    #[arg(long, default_value_t = 1)]
    dp_size: u32,
    /// Only for a member of a multi-server DP deployment: the global rank of its first rank, as
    /// vLLM's `--data-parallel-start-rank` (labels and accepted pins then start there). A server
    /// that is its own deployment, the common case, numbers its ranks from 0.
    #[arg(long, default_value_t = 0)]
    start_rank: u32,
    /// Which numbering the pinning header is validated against.
    #[arg(long, value_enum, default_value = "global")]
    rank_numbering: Numbering,
    /// Reported KV usage per local rank, in order (pinned, whatever the real occupancy).
    #[arg(long, value_delimiter = ',')]
    kv_usage: Vec<f64>,
    /// Capacity taken by background load per local rank (0..1): the rank really is busy.
    #[arg(long, value_delimiter = ',')]
    preload: Vec<f64>,
    /// GLOBAL ranks whose series are left out of /metrics.
    #[arg(long, value_delimiter = ',')]
    dark_ranks: Vec<u32>,
    /// GLOBAL ranks that report invalid values (NaN KV, negative counts).
    #[arg(long, value_delimiter = ',')]
    garbage_ranks: Vec<u32>,
    /// KV capacity of each rank in tokens. Default: Llama-3.1-8B (bf16, 128 KiB of KV a token)
    /// on one 80 GB GPU under vLLM (--gpu-memory-utilization 0.9): 71.3 GiB less 15 GiB of
    /// weights and 2.5 GiB of runtime leaves 53.8 GiB of KV, 27,557 blocks of 16 tokens.
    #[arg(long, default_value_t = deployment::CAPACITY_TOKENS)]
    capacity_tokens: u64,
    /// Decode rate of one request alone on its rank, tokens per second (each other running
    /// request slows it 2%). Default: that model on an H100 SXM at a small batch, 6.25 ms a
    /// token (16 GB of weights read per step at about 77% of its 3.35 TB/s).
    #[arg(long, default_value_t = deployment::DECODE_TOKENS_PER_SEC)]
    decode_rate: f64,
    /// Prefill rate, prompt tokens per second (a very high rate with a very high --decode-rate
    /// makes an instant engine, for measuring a proxy's overhead). Default: that model on an
    /// H100 SXM, 16 GFLOP a token at half its 989 bf16 TFLOPS (a 1k-token prompt in 34 ms).
    #[arg(long, default_value_t = deployment::PREFILL_TOKENS_PER_SEC)]
    prefill_rate: f64,
    /// Each rank's prefills run one at a time and hold up its decode steps while they run.
    #[arg(long)]
    prefill_interference: bool,
    /// Like vLLM's --max-num-seqs: requests running on each rank at most; the rest wait and
    /// count as waiting. Default: vLLM's for its OpenAI server on an 80 GB H100.
    #[arg(long, default_value_t = deployment::MAX_NUM_SEQS)]
    max_num_seqs: u32,
    /// Like vLLM's --scheduling-policy (vLLM flavor): a rank starts its waiting requests in
    /// arrival order (fcfs) or by the body's `priority`, lower first (priority), and stops at
    /// the first that does not fit, holding back those behind it.
    #[arg(long, value_enum, default_value = "fcfs")]
    scheduling_policy: super::SchedulingPolicy,
    /// Like vLLM's --enable-lora (vLLM flavor): serve LoRA adapters, each a model of its own
    /// listed by /v1/models with its parent, answering with its own text.
    #[arg(long)]
    enable_lora: bool,
    /// Like vLLM's --max-loras: distinct adapters one rank's batch runs at once; a request for
    /// another is set aside (not blocking those behind it) until one has no request running.
    #[arg(long, default_value_t = super::lora::config::DEFAULT_MAX_LORAS)]
    max_loras: u32,
    /// Like vLLM's --max-lora-rank (one of 1, 8, 16, 32, 64, 128, 256, 320, 512); accepted,
    /// it costs nothing here.
    #[arg(long, default_value_t = super::lora::config::DEFAULT_MAX_LORA_RANK)]
    max_lora_rank: u32,
    /// Like vLLM's --lora-modules: adapters served from the start, each `name=path` or JSON
    /// {"name": .., "path": .., "base_model_name": ..}, several after one flag. A local path
    /// (/, ./, ../, ~) must be a directory; anything else is taken as a Hugging Face id.
    #[arg(long, num_args = 1..)]
    lora_modules: Vec<String>,
    /// Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM does with
    /// VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (which is honoured as well).
    #[arg(long)]
    allow_runtime_lora: bool,
    /// Milliseconds loading an adapter into a rank's slot stalls that rank's steps, once per
    /// load (an adapter still loaded costs nothing). Default: an 80 MB adapter's copy to GPU.
    #[arg(long, default_value_t = super::lora::config::DEFAULT_LOAD.as_millis() as u64)]
    lora_load_ms: u64,
    /// Like vLLM's --enable-prefix-caching: ranks keep prompt blocks, cached prompt tokens skip
    /// prefill, /metrics reports vllm:prefix_cache_{queries,hits}_total.
    #[arg(long)]
    prefix_caching: bool,
    /// Like vLLM's --kv-events-config (JSON: enable_kv_cache_events, publisher "zmq",
    /// endpoint "tcp://*:PORT" to bind or "tcp://HOST:PORT" to connect, topic; rank r uses
    /// PORT + r): each rank publishes its prefix cache's KV events over ZeroMQ, and
    /// GET /kv_event_sources lists them. With replay_endpoint ("tcp://*:PORT" or
    /// "tcp://IP:PORT", rank r at PORT + r) each rank also keeps its last buffer_steps batches
    /// and serves them on a ZeroMQ ROUTER socket, as vLLM does. Turns on --prefix-caching.
    #[arg(long)]
    kv_events_config: Option<String>,
    /// A model directory (tokenizer.json, tokenizer_config.json, chat template) whose tokenizer
    /// names the prompt tokens and KV blocks, as a real engine's would. With
    /// --kv-events-config and no --tokenizer: the built-in tiny model's (the one the real vLLM
    /// capture was made with), whose files the repository ships in
    /// configs/tokenizers/tiny-llama/: a router's `[[models]]` with `tokenizer =
    /// "configs/tokenizers/tiny-llama"` matches the blocks exactly.
    #[arg(long)]
    tokenizer: Option<std::path::PathBuf>,
    /// Served model names, comma-separated; the first is the default for requests naming none.
    #[arg(long, value_delimiter = ',', default_value = "tiny-llama")]
    model: Vec<String>,
    /// Like `vllm serve --api-key`: guarded paths need `Authorization: Bearer KEY`, else 401.
    #[arg(long)]
    api_key: Option<String>,
    /// Status the failing share of OpenAI API requests is answered with (100..=599).
    #[arg(long, default_value_t = 503)]
    fail_status: u16,
    /// Share of OpenAI API requests that fail at once with --fail-status, in percent [0, 100].
    #[arg(long, default_value_t = 0.0)]
    fail_percent: f64,
    /// The first N OpenAI API requests fail at once with --fail-status (a decode server whose
    /// first KV pull fails: --role decode --fail-status 500 --fail-first 1).
    #[arg(long)]
    fail_first: Option<u64>,
    /// Accept generation requests and never answer them.
    #[arg(long)]
    hang_requests: bool,
    /// /metrics, /v1/loads and gRPC GetLoads never answer.
    #[arg(long)]
    hang_metrics: bool,
    /// /v1/models never answers.
    #[arg(long)]
    hang_models: bool,
    /// vLLM: every rank publishes its load gauges from the start, as `vllm serve
    /// --api-server-count 1` does; by default a rank publishes them only once it has run a
    /// request, as vLLM with DP and one API server per rank does (its counters are there, at 0).
    #[arg(long)]
    gauges_from_start: bool,
    /// What /health answers (100..=599).
    #[arg(long, default_value_t = 200)]
    health_status: u16,
    /// Die like kill -9 once N requests have been admitted (N >= 1).
    #[arg(long)]
    die_after: Option<u64>,
    /// Stop generating after K tokens and never finish the response.
    #[arg(long)]
    stall_after_tokens: Option<u64>,
    /// Serve HTTPS (and gRPC over TLS) with this certificate chain (PEM), like vLLM's
    /// --ssl-certfile; needs --tls-key.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The certificate's private key (PEM), like --ssl-keyfile.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// Require client certificates signed by this CA (PEM): mTLS, like --ssl-ca-certs with
    /// --ssl-cert-reqs 2.
    #[arg(long, requires = "tls_cert")]
    tls_client_ca: Option<std::path::PathBuf>,
    /// Prefill/decode disaggregation: serve as the prefill (P) or the decode (D) side of a pair
    /// (vLLM: kv_transfer_params, NixlConnector pull mode; SGLang: bootstrap_host/port/room).
    /// Absent: a colocated engine.
    #[arg(long, value_enum)]
    role: Option<RoleArg>,
    /// vLLM: the kv_transfer_config engine_id (P names it in remote_engine_id, with _dp<rank>
    /// under DP). Default: sim-<listen port>.
    #[arg(long)]
    engine_id: Option<String>,
    /// vLLM P: seconds blocks nobody pulled are kept (kv_lease_duration).
    #[arg(long, default_value_t = 30.0)]
    kv_lease: f64,
    /// vLLM P: seconds between its answer's head and body, blocks lent (a slow link; 0: none).
    #[arg(long, default_value_t = 0.0)]
    prefill_answer_delay: f64,
    /// vLLM P: side channel base port (VLLM_NIXL_SIDE_CHANNEL_PORT), rank r on BASE + r; 0: free.
    #[arg(long, default_value_t = 0)]
    side_port: u16,
    /// vLLM P: the host its answers name as remote_host (VLLM_NIXL_SIDE_CHANNEL_HOST).
    #[arg(long, default_value = "127.0.0.1")]
    side_host: String,
    /// SGLang P: the bootstrap server's port (--disaggregation-bootstrap-port). 0: a free port.
    #[arg(long, default_value_t = 0)]
    disaggregation_bootstrap_port: u16,
    /// SGLang P: seconds a prefilled room waits for its D (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT).
    #[arg(long, default_value_t = 300.0)]
    disaggregation_bootstrap_timeout: f64,
    /// SGLang D: seconds a request waits for its room's KV (SGLANG_DISAGGREGATION_WAITING_TIMEOUT).
    #[arg(long, default_value_t = 300.0)]
    disaggregation_waiting_timeout: f64,
}

/// A positive number of seconds, or an error naming the flag.
fn seconds(flag: &str, s: f64) -> Result<std::time::Duration, String> {
    std::time::Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("{flag} takes a positive number of seconds, got {s}"))
}

/// `rankgate mock-engine` as a command of its own, for building exactly the engine a command
/// line would ([`parse`]).
#[derive(clap::Parser)]
#[command(name = "mock-engine")]
struct Standalone {
    #[command(flatten)]
    args: Args,
}

/// The engine `rankgate mock-engine ARGS` would serve, its listen address and its gRPC one
/// (`argv` without the program and subcommand names): what a test starts to check the
/// command's defaults.
pub fn parse<I, T>(argv: I) -> Result<(SimConfig, SocketAddr, Option<SocketAddr>), String>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString>,
{
    let argv = std::iter::once(std::ffi::OsString::from("mock-engine"))
        .chain(argv.into_iter().map(Into::into));
    let cmd = <Standalone as clap::Parser>::try_parse_from(argv).map_err(|e| e.to_string())?;
    config(cmd.args)
}

/// Checks the flags and builds the engine's config; the error names the flag.
pub fn config(a: Args) -> Result<(SimConfig, SocketAddr, Option<SocketAddr>), String> {
    if let Some(v) = (a.kv_usage.iter().chain(&a.preload)).find(|v| !(0.0..=1.0).contains(*v)) {
        return Err(format!(
            "--kv-usage and --preload take values in [0, 1], got {v}"
        ));
    }
    if a.dp_size == 0 {
        return Err("--dp-size must be at least 1".into());
    }
    if a.model.iter().any(|m| m.is_empty()) {
        return Err(format!("--model takes non-empty names, got {:?}", a.model));
    }
    if !(a.decode_rate > 0.0 && a.prefill_rate > 0.0) {
        return Err("--decode-rate and --prefill-rate must be positive".into());
    }
    if a.max_num_seqs == 0 {
        return Err("--max-num-seqs must be at least 1".into());
    }
    if a.scheduling_policy == super::SchedulingPolicy::Priority
        && matches!(a.flavor, FlavorArg::Sglang)
    {
        return Err("--scheduling-policy priority is vLLM's: the SGLang flavor has none".into());
    }
    check_status(a.fail_status).map_err(|e| format!("--fail-status: {e}"))?;
    check_percent(a.fail_percent).map_err(|e| format!("--fail-percent: {e}"))?;
    check_status(a.health_status).map_err(|e| format!("--health-status: {e}"))?;
    if a.die_after == Some(0) {
        return Err(
            "--die-after must be at least 1 (an engine dead from the start is just a closed port)"
                .into(),
        );
    }
    let kv_events = match &a.kv_events_config {
        Some(j) => super::kv::KvEventsConfig::from_vllm_json(j).map_err(|e| e.to_string())?,
        None => None,
    };
    let tokenizer = match (&a.tokenizer, &kv_events) {
        (Some(dir), _) => {
            Some(super::model::tokenizer(dir).map_err(|e| format!("--tokenizer: {e}"))?)
        }
        (None, Some(_)) => Some(
            super::model::tiny_model_dir()
                .and_then(|d| super::model::tokenizer(&d))
                .map_err(|e| format!("the built-in tokenizer: {e}"))?,
        ),
        (None, None) => None,
    };
    let lora = lora(&a)?;
    let pd = super::PdConfig {
        engine_id: a.engine_id,
        kv_lease: seconds("--kv-lease", a.kv_lease)?,
        answer_delay: (a.prefill_answer_delay != 0.0)
            .then(|| seconds("--prefill-answer-delay", a.prefill_answer_delay))
            .transpose()?
            .unwrap_or_default(),
        side_port: a.side_port,
        side_host: a.side_host,
        bootstrap_port: a.disaggregation_bootstrap_port,
        bootstrap_timeout: seconds(
            "--disaggregation-bootstrap-timeout",
            a.disaggregation_bootstrap_timeout,
        )?,
        waiting_timeout: seconds(
            "--disaggregation-waiting-timeout",
            a.disaggregation_waiting_timeout,
        )?,
    };
    let cfg = SimConfig {
        role: a.role.map(|r| match r {
            RoleArg::Prefill => super::PdRole::Prefill,
            RoleArg::Decode => super::PdRole::Decode,
        }),
        pd,
        tokenizer,
        flavor: match a.flavor {
            FlavorArg::Vllm => Flavor::Vllm,
            FlavorArg::Sglang => Flavor::Sglang,
        },
        dp_size: a.dp_size,
        start_rank: a.start_rank,
        rank_numbering: match a.rank_numbering {
            Numbering::Global => RankNumbering::Global,
            Numbering::Local => RankNumbering::Local,
        },
        capacity_tokens: a.capacity_tokens,
        preload: a.preload,
        kv_usage: a.kv_usage,
        dark_ranks: a.dark_ranks,
        garbage_ranks: a.garbage_ranks,
        decode_tokens_per_sec: a.decode_rate,
        prefill_tokens_per_sec: a.prefill_rate,
        prefill_interference: a.prefill_interference,
        max_num_seqs: a.max_num_seqs,
        scheduling_policy: a.scheduling_policy,
        lora,
        // Events come from the prefix cache; vLLM has it on by default.
        prefix_caching: a.prefix_caching || kv_events.is_some(),
        kv_events,
        models: a.model,
        api_key: a.api_key,
        servicer_quirks: a.servicer_quirks,
        fail_status: a.fail_status,
        fail_percent: a.fail_percent,
        fail_first: a.fail_first,
        hang_requests: a.hang_requests,
        hang_metrics: a.hang_metrics,
        hang_models: a.hang_models,
        gauges_after_first_request: !a.gauges_from_start,
        health_status: a.health_status,
        die_after: a.die_after,
        stall_after_tokens: a.stall_after_tokens,
        tls: a
            .tls_cert
            .zip(a.tls_key)
            .map(|(cert_file, key_file)| rankgate::config::ListenerTls {
                cert_file,
                key_file,
                client_ca_file: a.tls_client_ca,
            }),
        ..SimConfig::default()
    };
    Ok((cfg, a.listen, a.grpc_listen))
}

/// The LoRA settings the flags give, checked; the error names the flag.
fn lora(a: &Args) -> Result<Option<super::lora::LoraConfig>, String> {
    let env = std::env::var("VLLM_ALLOW_RUNTIME_LORA_UPDATING").ok();
    if !a.enable_lora {
        if !a.lora_modules.is_empty() || a.allow_runtime_lora {
            return Err("--lora-modules and --allow-runtime-lora need --enable-lora".into());
        }
        return Ok(None);
    }
    if matches!(a.flavor, FlavorArg::Sglang) {
        return Err("--enable-lora is vLLM's here: the SGLang flavor serves no adapters".into());
    }
    let l = super::lora::LoraConfig {
        max_loras: a.max_loras,
        max_lora_rank: a.max_lora_rank,
        modules: (a.lora_modules.iter())
            .map(|m| super::lora::LoraModule::parse(m))
            .collect::<Result<_, _>>()?,
        runtime_updating: a.allow_runtime_lora
            || super::lora::config::runtime_updating_env(env.as_deref()),
        load_delay: std::time::Duration::from_millis(a.lora_load_ms),
    };
    l.check(&a.model).map_err(|e| {
        let flag = ["max_loras", "max_lora_rank", "load time"]
            .into_iter()
            .find(|k| e.contains(k))
            .map_or("--lora-modules", |k| match k {
                "max_loras" => "--max-loras",
                "max_lora_rank" => "--max-lora-rank",
                _ => "--lora-load-ms",
            });
        format!("{flag}: {e}")
    })?;
    Ok(Some(l))
}

/// Serves the engine until Ctrl-C (or until it dies, with `--die-after`).
pub async fn run(a: Args) -> Result<(), String> {
    let die_after = a.die_after;
    let (cfg, listen, grpc_listen) = config(a)?;
    let engine = SimEngine::start(listen, cfg)
        .await
        .map_err(|e| format!("cannot start on {listen}: {e}"))?;
    eprintln!("mock-engine listening on {}", engine.url());
    if let Some(p) = engine.bootstrap_port() {
        eprintln!("mock-engine bootstrap server on 127.0.0.1:{p}");
    }
    if !engine.side_ports().is_empty() {
        let ports = engine.side_ports();
        eprintln!(
            "mock-engine side channels (engine id {}) on ports {ports:?}",
            engine.engine_id()
        );
    }
    if let Some(g) = grpc_listen {
        let at = engine
            .start_grpc(g)
            .await
            .map_err(|e| format!("cannot serve gRPC on {g}: {e}"))?;
        eprintln!("mock-engine gRPC on {at}");
    }
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.map_err(|e| format!("waiting for Ctrl-C: {e}"))?,
        _ = engine.dead() => {
            return Err(format!(
                "died after {} admitted requests (--die-after)",
                die_after.unwrap_or(0)
            ))
        }
    }
    engine.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests;
