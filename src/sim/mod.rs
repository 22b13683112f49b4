//! The simulated engine: a real HTTP server that behaves like a vLLM or SGLang server hosting N
//! DP ranks, for tests, the demo and benchmarks.
//!
//! It honours rank pinning the way the real engines do (vLLM: `X-data-parallel-rank` header,
//! out-of-range -> 400, non-integer ignored; SGLang: `data_parallel_rank` / `routed_dp_rank` body
//! field or the header), streams tokens at a decode rate while each request holds KV on its rank,
//! and serves `/metrics` per rank in the real engine's format. Knobs that tests need at run time
//! (pinned KV, dark ranks, a slow `/metrics`) are methods on [`SimEngine`].

mod grpc;
pub mod rank;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use crate::http::{json_response, openai_error, respond};
use crate::worker::RankNumbering;

/// Which engine the simulator imitates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimFlavor {
    Vllm,
    Sglang,
}

impl SimFlavor {
    pub fn as_str(self) -> &'static str {
        match self {
            SimFlavor::Vllm => "vllm",
            SimFlavor::Sglang => "sglang",
        }
    }
}
use rank::Rank;

/// How the simulated engine is built.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub flavor: SimFlavor,
    pub dp_size: u32,
    pub start_rank: u32,
    /// Which numbering the pinning header is validated against (vLLM versions differ).
    pub rank_numbering: RankNumbering,
    /// KV capacity of each rank in tokens.
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
    /// Prompt tokens per second of prefill.
    pub prefill_tokens_per_sec: f64,
    pub model: String,
    /// Imitate smg-grpc-servicer 0.14.1: ignore the `dp_rank` filter and report the SUM of the
    /// ranks' capacities in every entry.
    pub servicer_quirks: bool,
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
            model: "tiny-llama".into(),
            servicer_quirks: false,
        }
    }
}

/// One rank's published numbers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RankReport {
    pub global: u32,
    pub usage: f64,
    pub running: i64,
    pub waiting: i64,
    pub used_tokens: i64,
    pub capacity: i64,
}

/// What the engine saw of one request, for tests to inspect.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    pub path: String,
    /// The `X-data-parallel-rank` header as received.
    pub rank_header: Option<String>,
    /// The body's `data_parallel_rank` as received.
    pub body_rank: Option<Value>,
    /// The global rank that served it.
    pub rank: u32,
}

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
    pub(crate) ranks: Vec<Rank>,
    knobs: RwLock<Knobs>,
    seen: Mutex<VecDeque<Seen>>,
    pub(crate) telemetry_requests: AtomicU64,
    next_id: AtomicU64,
}

/// How many requests the engine remembers for [`SimEngine::seen`].
const SEEN_CAP: usize = 4096;
const MAX_REQUEST_BYTES: usize = 16 * 1024 * 1024;

/// A running simulated engine.
pub struct SimEngine {
    pub addr: SocketAddr,
    sim: Arc<Sim>,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl SimEngine {
    /// Binds `listen` (port 0 picks a free port) and starts serving.
    pub async fn start(listen: SocketAddr, cfg: SimConfig) -> std::io::Result<SimEngine> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let ranks = (0..cfg.dp_size)
            .map(|i| {
                let preload = cfg.preload.get(i as usize).copied().unwrap_or(0.0);
                let capacity = cfg
                    .capacities
                    .get(i as usize)
                    .copied()
                    .unwrap_or(cfg.capacity_tokens);
                Rank::new(cfg.start_rank + i, capacity.max(1), preload)
            })
            .collect();
        let sim = Arc::new(Sim {
            knobs: RwLock::new(Knobs {
                kv_usage: cfg.kv_usage.clone(),
                dark_ranks: cfg.dark_ranks.clone(),
                metrics_delay: Duration::ZERO,
                native_failing: false,
            }),
            cfg,
            ranks,
            seen: Mutex::new(VecDeque::new()),
            telemetry_requests: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
        });
        let (shutdown, rx) = watch::channel(false);
        let s = sim.clone();
        let task = tokio::spawn(crate::http::serve(
            listener,
            move |req| s.clone().handle(req),
            rx,
        ));
        Ok(SimEngine {
            addr,
            sim,
            shutdown,
            task,
        })
    }

    /// Serves the gRPC side (`GetLoads`, `GetServerInfo`, health) on `listen`; returns its address.
    pub async fn start_grpc(&self, listen: SocketAddr) -> std::io::Result<SocketAddr> {
        let listener = grpc::bind(listen).await?;
        let addr = listener.local_addr()?;
        tokio::spawn(grpc::serve(
            listener,
            self.sim.clone(),
            self.shutdown.subscribe(),
        ));
        Ok(addr)
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests admitted per local rank.
    pub fn served(&self) -> Vec<u64> {
        self.sim
            .ranks
            .iter()
            .map(|r| r.served.load(Relaxed))
            .collect()
    }

    /// Current KV usage per local rank (real occupancy, ignoring pinned values).
    pub fn kv_usage(&self) -> Vec<f64> {
        self.sim.ranks.iter().map(|r| r.kv_usage()).collect()
    }

    /// Requests decoding right now, per local rank.
    pub fn running(&self) -> Vec<u32> {
        self.sim.ranks.iter().map(|r| r.counts().running).collect()
    }

    /// What the engine saw of recent requests, oldest first.
    pub fn seen(&self) -> Vec<Seen> {
        lock(&self.sim.seen).iter().cloned().collect()
    }

    /// How many telemetry requests (`/metrics`, `/v1/loads`, `GetLoads`) the engine answered.
    pub fn telemetry_requests(&self) -> u64 {
        self.sim.telemetry_requests.load(Relaxed)
    }

    /// Pins the reported KV usage per local rank (empty: report real occupancy).
    pub fn set_kv_usage(&self, kv: Vec<f64>) {
        write(&self.sim.knobs).kv_usage = kv;
    }

    /// Leaves these GLOBAL ranks' series out of `/metrics`.
    pub fn set_dark_ranks(&self, ranks: Vec<u32>) {
        write(&self.sim.knobs).dark_ranks = ranks;
    }

    /// Makes every `/metrics` answer wait this long first, like a saturated engine.
    pub fn set_metrics_delay(&self, d: Duration) {
        write(&self.sim.knobs).metrics_delay = d;
    }

    /// Breaks (or mends) the native load endpoints; `/metrics` keeps working.
    pub fn set_native_failing(&self, failing: bool) {
        write(&self.sim.knobs).native_failing = failing;
    }

    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let _ = self.task.await;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(m: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|p| p.into_inner())
}

fn read<T>(m: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|p| p.into_inner())
}

/// Response body of the simulated engine: whole, or SSE chunks as the generator sends them.
pub enum SimBody {
    Full(Option<Bytes>),
    Stream(mpsc::Receiver<Bytes>),
}

impl From<Bytes> for SimBody {
    fn from(b: Bytes) -> Self {
        SimBody::Full(Some(b))
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            SimBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            SimBody::Stream(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            SimBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            SimBody::Stream(_) => SizeHint::default(),
        }
    }
}

/// What a generation request asks for.
struct Job {
    chat: bool,
    stream: bool,
    prompt_tokens: u64,
    max_tokens: u64,
    id: u64,
}

impl Sim {
    async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Response<SimBody>, Infallible> {
        let path = req.uri().path().to_string();
        Ok(match (req.method(), path.as_str()) {
            (&Method::GET, "/health") => respond(StatusCode::OK, "text/plain", ""),
            (&Method::GET, "/metrics") => {
                self.telemetry_requests.fetch_add(1, Relaxed);
                let delay = read(&self.knobs).metrics_delay;
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                respond(
                    StatusCode::OK,
                    "text/plain; version=0.0.4",
                    self.render_metrics(),
                )
            }
            (&Method::GET, "/v1/models") => json_response(StatusCode::OK, &self.models()),
            (&Method::GET, "/v1/loads") if self.cfg.flavor == SimFlavor::Sglang => {
                self.telemetry_requests.fetch_add(1, Relaxed);
                if self.native_failing() {
                    openai_error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "InternalServerError",
                        "loads unavailable",
                    )
                } else {
                    self.http_loads(req.uri().query())
                }
            }
            (&Method::POST, "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings") => {
                match self.clone().generate(req, path).await {
                    Ok(r) => r,
                    Err((status, msg)) => openai_error(status, "BadRequestError", &msg),
                }
            }
            _ => openai_error(
                StatusCode::NOT_FOUND,
                "NotFoundError",
                &format!("no route {path}"),
            ),
        })
    }

    fn models(&self) -> Value {
        json!({"object": "list", "data": [{
            "id": self.cfg.model, "object": "model", "created": 0,
            "owned_by": self.cfg.flavor.as_str(), "root": self.cfg.model, "parent": null,
            "max_model_len": self.cfg.capacity_tokens,
        }]})
    }

    /// Parses a pin the way the engine would, returning the local rank index.
    fn resolve_rank(
        &self,
        header: Option<&str>,
        body_rank: Option<&Value>,
    ) -> Result<Option<usize>, (StatusCode, String)> {
        let requested: Option<i64> = match self.cfg.flavor {
            // vLLM silently ignores a header that is not an integer.
            SimFlavor::Vllm => header.and_then(|h| h.trim().parse().ok()),
            SimFlavor::Sglang => match body_rank {
                Some(v) => Some(v.as_i64().ok_or((
                    StatusCode::BAD_REQUEST,
                    format!("data_parallel_rank must be an integer, got {v}"),
                ))?),
                None => match header {
                    Some(h) => Some(h.trim().parse().map_err(|_| {
                        (
                            StatusCode::BAD_REQUEST,
                            format!("X-Data-Parallel-Rank {h:?} is not an integer"),
                        )
                    })?),
                    None => None,
                },
            },
        };
        let Some(r) = requested else { return Ok(None) };
        let base = match self.cfg.rank_numbering {
            RankNumbering::Global => self.cfg.start_rank as i64,
            RankNumbering::Local => 0,
        };
        let local = r - base;
        if local < 0 || local >= self.cfg.dp_size as i64 {
            return Err((
                StatusCode::BAD_REQUEST,
                format!(
                    "data_parallel_rank {r} is out of range [{base}, {}).",
                    base + self.cfg.dp_size as i64
                ),
            ));
        }
        Ok(Some(local as usize))
    }

    /// The engine's own balancing for unpinned requests: the rank with least KV reserved.
    fn least_loaded(&self) -> usize {
        (0..self.ranks.len())
            .min_by_key(|&i| {
                let r = &self.ranks[i];
                r.preload + r.counts().reserved
            })
            .unwrap_or(0)
    }

    async fn generate(
        self: Arc<Self>,
        req: Request<Incoming>,
        path: String,
    ) -> Result<Response<SimBody>, (StatusCode, String)> {
        let header = req
            .headers()
            .get("x-data-parallel-rank")
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        let body = Limited::new(req.into_body(), MAX_REQUEST_BYTES)
            .collect()
            .await
            .map_err(|e| (StatusCode::BAD_REQUEST, format!("reading body: {e}")))?
            .to_bytes();
        let v: Value = serde_json::from_slice(&body)
            .map_err(|e| (StatusCode::BAD_REQUEST, format!("invalid JSON: {e}")))?;
        let body_rank = v
            .get("data_parallel_rank")
            .or_else(|| v.get("routed_dp_rank"))
            .cloned();
        let local = self
            .resolve_rank(header.as_deref(), body_rank.as_ref())?
            .unwrap_or_else(|| self.least_loaded());
        {
            let mut seen = lock(&self.seen);
            if seen.len() == SEEN_CAP {
                seen.pop_front();
            }
            seen.push_back(Seen {
                path: path.clone(),
                rank_header: header,
                body_rank,
                rank: self.ranks[local].global,
            });
        }
        let prompt_text_len = match (v.get("messages"), v.get("prompt"), v.get("input")) {
            (Some(m), _, _) => m.to_string().len(),
            (_, Some(p), _) | (_, _, Some(p)) => {
                p.as_str().map_or_else(|| p.to_string().len(), str::len)
            }
            _ => 0,
        };
        let embeddings = path == "/v1/embeddings";
        let job = Job {
            chat: path == "/v1/chat/completions",
            stream: v.get("stream").and_then(Value::as_bool).unwrap_or(false) && !embeddings,
            // About four characters per token, as for English text.
            prompt_tokens: (prompt_text_len as u64 / 4).max(1),
            max_tokens: if embeddings {
                0
            } else {
                v.get("max_tokens")
                    .and_then(Value::as_u64)
                    .unwrap_or(16)
                    .max(1)
            },
            id: self.next_id.fetch_add(1, Relaxed),
        };
        if job.stream {
            let (tx, rx) = mpsc::channel(16);
            tokio::spawn(async move { self.run(local, job, Some(tx)).await });
            let mut resp = Response::new(SimBody::Stream(rx));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                http::HeaderValue::from_static("text/event-stream"),
            );
            Ok(resp)
        } else if embeddings {
            let _adm = self.ranks[local].admit(job.prompt_tokens, 0).await;
            Ok(json_response(
                StatusCode::OK,
                &json!({
                    "object": "list", "model": self.cfg.model,
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3, 0.4]}],
                    "usage": {"prompt_tokens": job.prompt_tokens, "total_tokens": job.prompt_tokens},
                }),
            ))
        } else {
            let text = self.run(local, job, None).await;
            Ok(json_response(StatusCode::OK, &text))
        }
    }

    /// Admits the job on its rank and decodes it. Streaming jobs send SSE chunks to `tx` and stop
    /// early (freeing their KV) if the client goes away; others return the whole completion.
    async fn run(&self, local: usize, job: Job, tx: Option<mpsc::Sender<Bytes>>) -> Value {
        let rank = &self.ranks[local];
        let mut adm = rank.admit(job.prompt_tokens, job.max_tokens).await;
        let prefill =
            Duration::from_secs_f64(job.prompt_tokens as f64 / self.cfg.prefill_tokens_per_sec);
        tokio::time::sleep(prefill).await;
        let kind = if job.chat { "chatcmpl" } else { "cmpl" };
        let id = format!("{kind}-sim{}", job.id);
        let mut text = String::new();
        for i in 0..job.max_tokens {
            if i > 0 {
                let running = rank.counts().running.saturating_sub(1) as f64;
                let itl =
                    (1.0 + running * self.cfg.batch_slowdown) / self.cfg.decode_tokens_per_sec;
                tokio::time::sleep(Duration::from_secs_f64(itl)).await;
            }
            adm.grow();
            let token = format!("t{} ", i % 10);
            if let Some(tx) = &tx {
                let delta = if job.chat {
                    json!({"index": 0, "delta": {"content": token}, "logprobs": null, "finish_reason": null})
                } else {
                    json!({"index": 0, "text": token, "logprobs": null, "finish_reason": null})
                };
                if tx.send(self.chunk(&id, job.chat, delta)).await.is_err() {
                    return Value::Null;
                }
            } else {
                text.push_str(&token);
            }
        }
        let usage = json!({"prompt_tokens": job.prompt_tokens, "completion_tokens": job.max_tokens,
            "total_tokens": job.prompt_tokens + job.max_tokens});
        if let Some(tx) = &tx {
            let mut last = serde_json::Map::new();
            last.insert("id".into(), json!(id));
            last.insert(
                "object".into(),
                json!(if job.chat {
                    "chat.completion.chunk"
                } else {
                    "text_completion"
                }),
            );
            last.insert("model".into(), json!(self.cfg.model));
            last.insert("choices".into(), json!([]));
            last.insert("usage".into(), usage);
            let _ = tx
                .send(Bytes::from(format!("data: {}\n\n", Value::Object(last))))
                .await;
            let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
            return Value::Null;
        }
        let choice = if job.chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": text, "finish_reason": "length"})
        };
        json!({"id": id, "object": if job.chat { "chat.completion" } else { "text_completion" },
            "model": self.cfg.model, "choices": [choice], "usage": usage})
    }

    fn chunk(&self, id: &str, chat: bool, choice: Value) -> Bytes {
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let v = json!({"id": id, "object": object, "model": self.cfg.model, "choices": [choice]});
        Bytes::from(format!("data: {v}\n\n"))
    }

    pub(crate) fn native_failing(&self) -> bool {
        read(&self.knobs).native_failing
    }

    /// What each published rank reports right now: dark ranks are left out, garbage ranks
    /// report NaN usage and negative counts. Shared by `/metrics`, `/v1/loads` and `GetLoads`.
    pub(crate) fn rank_reports(&self) -> Vec<RankReport> {
        let knobs = read(&self.knobs).clone();
        let total_capacity: u64 = self.ranks.iter().map(|r| r.capacity).sum();
        self.ranks
            .iter()
            .enumerate()
            .filter(|(_, r)| !knobs.dark_ranks.contains(&r.global))
            .map(|(i, rank)| {
                let c = rank.counts();
                let usage = knobs
                    .kv_usage
                    .get(i)
                    .copied()
                    .unwrap_or_else(|| rank.kv_usage());
                let garbage = self.cfg.garbage_ranks.contains(&rank.global);
                RankReport {
                    global: rank.global,
                    usage: if garbage { f64::NAN } else { usage },
                    running: if garbage { -1 } else { c.running as i64 },
                    waiting: c.waiting as i64,
                    used_tokens: (usage * rank.capacity as f64).round() as i64,
                    // The real servicer reports the sum over ranks in every entry.
                    capacity: if self.cfg.servicer_quirks {
                        total_capacity
                    } else {
                        rank.capacity
                    } as i64,
                }
            })
            .collect()
    }

    /// The entries a load report carries for an optional `dp_rank` filter, with the servicer's
    /// semantics: an unmanaged rank is an error, an explicit 0 is a real filter.
    pub(crate) fn loads_for(&self, filter: Option<i64>) -> Result<Vec<RankReport>, String> {
        let reports = self.rank_reports();
        let Some(r) = filter else { return Ok(reports) };
        let range = self.cfg.start_rank as i64..(self.cfg.start_rank + self.cfg.dp_size) as i64;
        if !range.contains(&r) {
            return Err(format!(
                "dp_rank {r} is not managed by this server (ranks {range:?})"
            ));
        }
        if self.cfg.servicer_quirks {
            return Ok(reports);
        }
        Ok(reports
            .into_iter()
            .filter(|x| x.global as i64 == r)
            .collect())
    }

    /// SGLang's `GET /v1/loads[?dp_rank=N]`.
    fn http_loads(&self, query: Option<&str>) -> Response<SimBody> {
        let filter = query
            .unwrap_or("")
            .split('&')
            .find_map(|kv| kv.strip_prefix("dp_rank="))
            .map(|v| v.parse::<i64>());
        let filter = match filter.transpose() {
            Ok(f) => f,
            Err(_) => {
                return openai_error(
                    StatusCode::BAD_REQUEST,
                    "BadRequestError",
                    "dp_rank must be an integer",
                )
            }
        };
        match self.loads_for(filter) {
            Ok(entries) => {
                let loads: Vec<Value> = entries
                    .iter()
                    .map(|e| {
                        json!({"dp_rank": e.global, "num_running_reqs": e.running, "num_waiting_reqs": e.waiting,
                            "num_total_reqs": e.running + e.waiting, "num_used_tokens": e.used_tokens,
                            "max_total_num_tokens": e.capacity,
                            // JSON has no NaN: a garbage rank reports an out-of-range usage.
                            "token_usage": if e.usage.is_finite() { e.usage } else { -1.0 }})
                    })
                    .collect();
                json_response(
                    StatusCode::OK,
                    &json!({"timestamp": "1970-01-01T00:00:00Z", "version": "sim",
                    "dp_rank_count": loads.len(), "loads": loads}),
                )
            }
            Err(msg) => openai_error(StatusCode::BAD_REQUEST, "BadRequestError", &msg),
        }
    }

    /// `/metrics` in the engine's own format: one series per rank, keyed by `engine` (vLLM) or
    /// `dp_rank` (SGLang), carrying GLOBAL rank ids.
    fn render_metrics(&self) -> String {
        let (kv_name, run_name, wait_name, label) = match self.cfg.flavor {
            SimFlavor::Vllm => (
                "vllm:kv_cache_usage_perc",
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "engine",
            ),
            SimFlavor::Sglang => (
                "sglang:token_usage",
                "sglang:num_running_reqs",
                "sglang:num_queue_reqs",
                "dp_rank",
            ),
        };
        let model = &self.cfg.model;
        let reports = self.rank_reports();
        let mut o = String::new();
        for (name, kind) in [(kv_name, 0), (run_name, 1), (wait_name, 2)] {
            let _ = writeln!(o, "# HELP {name} simulated\n# TYPE {name} gauge");
            for r in &reports {
                let value = match kind {
                    0 => r.usage.to_string(),
                    1 => r.running.to_string(),
                    _ => r.waiting.to_string(),
                };
                let _ = writeln!(
                    o,
                    "{name}{{{label}=\"{}\",model_name=\"{model}\"}} {value}",
                    r.global
                );
            }
        }
        if self.cfg.flavor == SimFlavor::Vllm {
            o.push_str(
                "# HELP vllm:cache_config_info simulated\n# TYPE vllm:cache_config_info gauge\n",
            );
            for r in &reports {
                let _ = writeln!(
                    o,
                    "vllm:cache_config_info{{block_size=\"16\",engine=\"{}\",kv_cache_size_tokens=\"{}\",num_gpu_blocks=\"{}\"}} 1.0",
                    r.global,
                    r.capacity,
                    r.capacity / 16
                );
            }
        }
        o
    }
}
