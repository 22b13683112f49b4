//! The simulated engine: a real HTTP server that behaves like a vLLM or SGLang server hosting N
//! DP ranks, for tests, the demo and benchmarks.
//!
//! It honours rank pinning the way the real engines do (vLLM: `X-data-parallel-rank` header,
//! out-of-range -> 400, non-integer ignored; SGLang: `data_parallel_rank` / `routed_dp_rank` body
//! field or the header), streams tokens at a decode rate while each request holds KV on its rank,
//! and serves `/metrics` per rank in the real engine's format. Knobs that tests need at run time
//! (pinned KV, dark ranks, a slow `/metrics`, broken native endpoints) and the fault knobs a
//! router's resilience is tested with (failing, hanging, stalling, dying) are methods on
//! [`SimEngine`].
//!
//! Besides the OpenAI API it serves every endpoint a router proxies to vLLM or SGLang (the
//! Responses and Anthropic Messages APIs, audio, tokenizer, pooling, scoring and reranking,
//! SGLang's native ones), each pinned like generation is and marked with the rank that served it
//! ([`SIM_RANK_HEADER`]); it may serve several model names and require an API key. `routes` maps
//! paths to endpoints, `serve` holds the HTTP surface and the prelude every proxied request goes
//! through, `generate` the decoding APIs, `pooling` the answers without decoding, `multipart` the
//! audio forms, `info` what the engine says about itself, `auth` the API key check, `telemetry`
//! what the ranks publish, `grpc` the gRPC services and `grpc_decode` their inference calls,
//! `rank` the KV and queue model, `queue` the scheduler settings that run the queue (vLLM's
//! `--max-num-seqs`, `--scheduling-policy`, a request's `priority`), `prefix` its prefix cache, `kv` the KV-cache events the ranks
//! publish over ZeroMQ as vLLM does, `faults` the fault knobs and `net` the accept loop that can
//! die like a killed process. `pd` makes the engine the prefill or the decode side of a pair
//! ([`SimConfig::role`]); `deployment` holds a real rank's figures, `rankgate mock-engine`'s.
//! `lora` serves LoRA adapters as vLLM does ([`SimConfig::lora`]).

mod auth;
pub mod cli;
mod compute;
pub mod deployment;
mod faults;
mod generate;
mod grpc;
mod grpc_decode;
mod info;
pub mod kv;
pub mod lora;
pub mod model;
mod multipart;
mod net;
mod observe;
pub mod pd;
mod pooling;
pub mod prefix;
mod queue;
pub mod rank;
mod routes;
mod serve;
mod sync;
mod telemetry;
mod tokenizer;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::watch;

use faults::Faults;
pub use faults::{check_percent, check_status, FaultError};
pub use grpc_decode::GrpcSeen;
pub use observe::Seen;
pub use pd::{PdConfig, PdCounts, PdRole};
pub use queue::SchedulingPolicy;
use rank::Rank;
use rankgate::worker::RankNumbering;
pub use serve::SimBody;
use sync::{lock, read, write};
use telemetry::RankReport;
pub use tokenizer::{PromptIds, SimTokenizer, TextIds};

/// Which engine the simulator imitates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SimFlavor {
    Vllm,
    Sglang,
}

/// Waits `d` of simulated work. Waits far below the timer's 1 ms tick only yield: an engine set
/// to decode a million tokens a second (the benchmarks' instant engine) must not take a tick per
/// token.
pub(crate) async fn pause(d: Duration) {
    if d < Duration::from_micros(100) {
        tokio::task::yield_now().await;
    } else {
        tokio::time::sleep(d).await;
    }
}

impl From<SimFlavor> for rankgate::worker::Flavor {
    fn from(f: SimFlavor) -> Self {
        match f {
            SimFlavor::Vllm => rankgate::worker::Flavor::Vllm,
            SimFlavor::Sglang => rankgate::worker::Flavor::Sglang,
        }
    }
}

impl SimFlavor {
    pub fn as_str(self) -> &'static str {
        match self {
            SimFlavor::Vllm => "vllm",
            SimFlavor::Sglang => "sglang",
        }
    }
}

/// The model a default [`SimConfig`] serves.
pub const DEFAULT_MODEL: &str = "tiny-llama";

/// How the simulated engine is built. `default()` is small and quick, as tests count on.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub flavor: SimFlavor,
    pub dp_size: u32,
    pub start_rank: u32,
    /// Which numbering the pinning header is validated against (vLLM versions differ).
    pub rank_numbering: RankNumbering,
    /// KV capacity of each rank in tokens (4,096 by default; a real rank: [`deployment`]).
    pub capacity_tokens: u64,
    /// Per local rank: a capacity overriding `capacity_tokens` (heterogeneous ranks).
    pub capacities: Vec<u64>,
    /// Per local rank: capacity taken by background load (0..1), making the rank really busy.
    pub preload: Vec<f64>,
    /// Per local rank: a KV usage to report whatever the real occupancy is.
    pub kv_usage: Vec<f64>,
    /// GLOBAL ranks whose series are left out of `/metrics`.
    pub dark_ranks: Vec<u32>,
    /// GLOBAL ranks that report invalid values (NaN KV usage, negative counts).
    pub garbage_ranks: Vec<u32>,
    /// Tokens per second one request decodes at when its rank runs nothing else.
    pub decode_tokens_per_sec: f64,
    /// How much each other running request slows decoding (a batch of b decodes at rate/(1+b*x)).
    pub batch_slowdown: f64,
    /// Prompt tokens per second of prefill; prompt tokens found in the prefix cache skip it.
    pub prefill_tokens_per_sec: f64,
    /// Each rank's prefills run one at a time and hold up its decode steps while they run
    /// ([`compute`]); off (the default), prefills run side by side and slow nothing.
    pub prefill_interference: bool,
    /// Like vLLM's `--enable-prefix-caching`: generation requests share and keep their prompt's
    /// KV blocks per rank (`prefix`), skip the prefill of cached ones, and `/metrics` reports
    /// `vllm:prefix_cache_{queries,hits}_total`. Off by default so that KV per request is the
    /// plain prompt + output that most tests count on.
    pub prefix_caching: bool,
    /// The model names the engine serves, the first being the default for a request that names
    /// none. Like `vllm serve --served-model-name a b`: names of one model, all listed by
    /// `/v1/models`; any other name is answered 404. Never empty ([`SimEngine::start`] refuses).
    pub models: Vec<String>,
    /// Like `--api-key`: the requests the engine guards need this key (which paths and headers
    /// depend on the flavor, see `auth`), or get 401. `None` leaves everything open.
    pub api_key: Option<String>,
    /// Imitate smg-grpc-servicer 0.14.1: ignore the `dp_rank` filter and report the SUM of the
    /// ranks' capacities in every entry.
    pub servicer_quirks: bool,
    /// The status the failing share of proxied requests is answered with (100..=599).
    pub fail_status: u16,
    /// Share of proxied requests (every POST endpoint) answered at once with `fail_status`, in
    /// percent; 0 is off.
    pub fail_percent: f64,
    /// The first N proxied requests are answered at once with `fail_status`, before any byte
    /// of an answer (a decode server whose first KV pull fails, as vLLM's first NIXL
    /// handshake can); the rest as usual. `None`: off.
    pub fail_first: Option<u64>,
    /// Proxied requests are accepted and never answered.
    pub hang_requests: bool,
    /// `/metrics`, `/v1/loads` and gRPC `GetLoads` never answer.
    pub hang_metrics: bool,
    /// `/v1/models` never answers.
    pub hang_models: bool,
    /// What `/health` answers (gRPC health reports NOT_SERVING unless it is a 2xx).
    pub health_status: u16,
    /// Die like `kill -9` once this many requests have been admitted into ranks.
    pub die_after: Option<u64>,
    /// Generation stops after this many tokens and the response never ends.
    pub stall_after_tokens: Option<u64>,
    /// Serve HTTPS (and gRPC over TLS) with this certificate, like `vllm serve --ssl-certfile
    /// --ssl-keyfile [--ssl-ca-certs --ssl-cert-reqs 2]`; `client_ca_file` requires clients
    /// to present a certificate (mTLS).
    pub tls: Option<rankgate::config::ListenerTls>,
    /// Like vLLM's `--kv-events-config`: each rank publishes its prefix cache's KV events
    /// ([`kv`]). Only meaningful with `prefix_caching`. `None` (the default) publishes nothing.
    pub kv_events: Option<kv::KvEventsConfig>,
    /// Token ids for prompts and answers in place of the 4-bytes-a-token stand-in (see
    /// [`prefix`]); `None` (the default) keeps the stand-in.
    pub tokenizer: Option<SimTokenizer>,
    /// Prefill/decode disaggregation ([`pd`]): the side of a pair this engine is; `None` (the
    /// default) is the colocated engine.
    pub role: Option<PdRole>,
    /// The disaggregation settings of a role server (lease, ports, timeouts).
    pub pd: PdConfig,
    /// vLLM only, as vLLM with DP and one API server per rank: a rank publishes no load gauges
    /// (`/metrics`, so no `/v1/loads` or `GetLoads` entry) until it has admitted a request since
    /// the engine started; its counters (`vllm:request_success_total`) are there from the
    /// start, at 0. `rankgate mock-engine` has it on (off: `--gauges-from-start`, as `vllm serve
    /// --api-server-count 1`); [`SimConfig::default`], the tests' small engine, has it off, so
    /// a test that sets a rank's reported usage sees it at once.
    pub gauges_after_first_request: bool,
    /// Like vLLM's `--max-num-seqs`: requests running on a rank at most, the rest wait
    /// ([`queue`]); [`deployment::MAX_NUM_SEQS`] by default.
    pub max_num_seqs: u32,
    /// Like vLLM's `--scheduling-policy`: the order a vLLM rank's waiting requests start in.
    pub scheduling_policy: SchedulingPolicy,
    /// Like vLLM's `--enable-lora` and its settings (vLLM flavor): adapters served as models,
    /// at most `max_loras` per rank's batch ([`lora`]). `None` (the default): no adapters.
    pub lora: Option<lora::LoraConfig>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            flavor: SimFlavor::Vllm,
            dp_size: 2,
            start_rank: 0,
            rank_numbering: RankNumbering::Global,
            capacity_tokens: 4096,
            capacities: Vec::new(),
            preload: Vec::new(),
            kv_usage: Vec::new(),
            dark_ranks: Vec::new(),
            garbage_ranks: Vec::new(),
            decode_tokens_per_sec: 200.0,
            batch_slowdown: 0.02,
            prefill_tokens_per_sec: 20_000.0,
            prefill_interference: false,
            prefix_caching: false,
            models: vec![DEFAULT_MODEL.into()],
            api_key: None,
            servicer_quirks: false,
            fail_status: 503,
            fail_percent: 0.0,
            fail_first: None,
            hang_requests: false,
            hang_metrics: false,
            hang_models: false,
            health_status: 200,
            die_after: None,
            stall_after_tokens: None,
            tls: None,
            kv_events: None,
            tokenizer: None,
            role: None,
            pd: PdConfig::default(),
            gauges_after_first_request: false,
            max_num_seqs: deployment::MAX_NUM_SEQS,
            scheduling_policy: SchedulingPolicy::Fcfs,
            lora: None,
        }
    }
}

impl SimConfig {
    /// The DP size the engine reports of itself (vLLM `GetServerInfo.data_parallel_size`,
    /// SGLang `dp_size`): the whole deployment's, which for a member of a multi-server
    /// deployment is at least its last rank + 1.
    pub fn deployment_size(&self) -> u32 {
        self.start_rank + self.dp_size
    }
}

/// The response header naming the GLOBAL rank that served a proxied request, so a client (or a
/// test behind a router) sees where its request ran.
pub const SIM_RANK_HEADER: &str = "x-sim-rank";

/// Knobs that change while the engine runs.
#[derive(Debug, Clone, Default)]
struct Knobs {
    kv_usage: Vec<f64>,
    dark_ranks: Vec<u32>,
    metrics_delay: Duration,
    /// `/v1/loads` answers 500 and `GetLoads` UNAVAILABLE, as if the native endpoints broke.
    native_failing: bool,
}

pub(crate) struct Sim {
    pub(crate) cfg: SimConfig,
    /// The certificate both listeners serve, when `cfg.tls` is set.
    pub(crate) tls: Option<Arc<rankgate::tls::ServerTls>>,
    pub(crate) ranks: Vec<Rank>,
    /// Each rank's compute, which prefills and decode steps share with interference on.
    compute: compute::Compute,
    knobs: RwLock<Knobs>,
    seen: Mutex<VecDeque<Seen>>,
    /// What the engine saw of gRPC inference calls.
    grpc_seen: Mutex<VecDeque<GrpcSeen>>,
    /// Generations running under a request id, for `Abort`.
    running: Mutex<grpc_decode::Running>,
    /// Request ids `Abort` named, oldest first.
    aborted: Mutex<VecDeque<String>>,
    pub(crate) telemetry_requests: AtomicU64,
    next_id: AtomicU64,
    pub(crate) faults: Faults,
    /// `true` once the engine is killed; every server and hung request watches it.
    kill: watch::Sender<bool>,
    /// Servers (HTTP, gRPC) still running, for [`SimEngine::dead`].
    servers: watch::Sender<usize>,
    /// The graceful shutdown signal, which releases hung requests.
    shutdown: watch::Receiver<bool>,
    /// Each rank's KV-event publisher, with events on (local rank order).
    pub(crate) kv_publishers: Vec<kv::RankPublisher>,
    /// Stops the publishers: on kill and on shutdown (and when the sim goes).
    kv_stop: watch::Sender<bool>,
    /// A role server's side channels, bootstrap server, leases, rooms and counters.
    pub(crate) pd: pd::PdState,
    /// The adapters served, with LoRA on.
    pub(crate) lora: Option<lora::Lora>,
}

/// How many requests the engine remembers for [`SimEngine::seen`].
const SEEN_CAP: usize = 4096;
const MAX_REQUEST_BYTES: usize = 16 * 1024 * 1024;

/// A running simulated engine. Dropping it stops the server (the shutdown channel closes), so
/// tests keep it bound for as long as they need the engine.
pub struct SimEngine {
    pub addr: SocketAddr,
    sim: Arc<Sim>,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl SimEngine {
    /// Binds `listen` (port 0 picks a free port) and starts serving. Fault knobs out of range
    /// and an empty model list are an `InvalidInput` error.
    pub async fn start(listen: SocketAddr, cfg: SimConfig) -> std::io::Result<SimEngine> {
        let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
        let faults = Faults::new(&cfg).map_err(|e| invalid(e.to_string()))?;
        cfg.check_queue().map_err(invalid)?;
        cfg.check_lora().map_err(invalid)?;
        if cfg.models.is_empty() || cfg.models.iter().any(|m| m.is_empty()) {
            return Err(invalid(format!(
                "models must be a non-empty list of non-empty names, got {:?}",
                cfg.models
            )));
        }
        let tls = (cfg.tls.as_ref())
            .map(|t| rankgate::tls::ServerTls::load("sim tls", t))
            .transpose()
            .map_err(|e| invalid(e.to_string()))?;
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let pd_listeners = pd::bind(&cfg).await?;
        let kv_stop = watch::Sender::new(false);
        let mut ranks = Vec::new();
        let mut kv_publishers = Vec::new();
        for i in 0..cfg.dp_size {
            let preload = cfg.preload.get(i as usize).copied().unwrap_or(0.0);
            let capacity = cfg
                .capacities
                .get(i as usize)
                .copied()
                .unwrap_or(cfg.capacity_tokens);
            let mut rank = Rank::new(cfg.start_rank + i, capacity.max(1), preload)
                .with_queueing(cfg.queueing());
            if let Some(l) = &cfg.lora {
                rank = rank.with_lora(l.max_loras, l.load_delay);
            }
            if let Some(kc) = &cfg.kv_events {
                let events = Arc::new(kv::RankEvents::default());
                rank = rank.with_events(events.clone());
                kv_publishers.push(kv::start(kc, rank.global, events, kv_stop.subscribe()).await?);
            }
            ranks.push(rank);
        }
        let (shutdown, shutdown_rx) = watch::channel(false);
        let pd_state = pd::PdState::new(&cfg, addr, &pd_listeners);
        let lora = (cfg.lora.as_ref()).map(|l| lora::Lora::new(l, &cfg.models));
        let sim = Arc::new(Sim {
            lora,
            knobs: RwLock::new(Knobs {
                kv_usage: cfg.kv_usage.clone(),
                dark_ranks: cfg.dark_ranks.clone(),
                metrics_delay: Duration::ZERO,
                native_failing: false,
            }),
            compute: compute::Compute::new(cfg.dp_size),
            cfg,
            ranks,
            seen: Mutex::new(VecDeque::new()),
            grpc_seen: Mutex::new(VecDeque::new()),
            running: Mutex::default(),
            aborted: Mutex::new(VecDeque::new()),
            telemetry_requests: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
            faults,
            kill: watch::Sender::new(false),
            servers: watch::Sender::new(0),
            shutdown: shutdown_rx.clone(),
            tls,
            kv_publishers,
            kv_stop,
            pd: pd_state,
        });
        pd::serve(&sim, pd_listeners, &sim.shutdown);
        let s = sim.clone();
        let task = tokio::spawn(net::serve(
            listener,
            sim.tls.clone(),
            move |req| s.clone().handle(req),
            shutdown_rx,
            sim.kill.subscribe(),
            net::Running::new(&sim.servers),
        ));
        Ok(SimEngine {
            addr,
            sim,
            shutdown,
            task,
        })
    }

    /// Serves the gRPC side (`Generate`, `Embed`, `Abort`, `GetLoads`, vLLM's `GetServerInfo`,
    /// health) on `listen`; returns its address.
    /// It dies with the engine.
    pub async fn start_grpc(&self, listen: SocketAddr) -> std::io::Result<SocketAddr> {
        if self.sim.is_dead() {
            return Err(std::io::Error::other("the simulated engine is dead"));
        }
        let listener = grpc::bind(listen).await?;
        let addr = listener.local_addr()?;
        let running = net::Running::new(&self.sim.servers);
        tokio::spawn(grpc::serve(
            listener,
            self.sim.clone(),
            self.shutdown.subscribe(),
            running,
        ));
        Ok(addr)
    }

    pub fn url(&self) -> String {
        let scheme = if self.sim.tls.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.addr)
    }

    /// Restarts local rank `local`'s engine process as far as its caches go: see
    /// [`rank::Rank::restart`] (the prefix cache empties, requests in flight finish but are no
    /// longer cached, the KV-event stream starts again at sequence 0 with `AllBlocksCleared`).
    /// Out-of-range ranks are ignored.
    pub fn restart_rank(&self, local: usize) {
        if let Some(r) = self.sim.ranks.get(local) {
            r.restart();
        }
    }

    /// Like vLLM's `POST /reset_prefix_cache` on every rank: each rank with no running request
    /// drops its cached blocks and publishes `AllBlocksCleared` (its numbering goes on). Returns,
    /// per local rank, whether it did.
    pub fn reset_prefix_cache(&self) -> Vec<bool> {
        self.sim
            .ranks
            .iter()
            .map(|r| r.reset_prefix_cache())
            .collect()
    }

    /// Restarts every rank ([`SimEngine::restart_rank`]), as a restarted engine server does.
    pub fn restart(&self) {
        for r in &self.sim.ranks {
            r.restart();
        }
    }

    pub async fn shutdown(self) {
        let _ = self.sim.kv_stop.send(true);
        let _ = self.shutdown.send(true);
        let _ = self.task.await;
    }
}

impl Sim {
    /// A prompt's full KV blocks when prefix caching is on; `None` when it is off.
    pub(crate) fn prompt_blocks(&self, text: &[u8], tokens: u64) -> Option<prefix::Blocks> {
        self.cfg
            .prefix_caching
            .then(|| self.held(prefix::Blocks::of_text(text, tokens)))
    }

    /// `b` as a request holds it: the token ids only matter to KV events, so without them a
    /// request does not carry a copy of its prompt's ids while it runs.
    pub(crate) fn held(&self, mut b: prefix::Blocks) -> prefix::Blocks {
        if self.cfg.kv_events.is_none() {
            b.tokens = Vec::new();
        }
        b
    }
}
