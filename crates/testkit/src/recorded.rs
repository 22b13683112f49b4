//! A fake vLLM 0.32 server with two DP ranks built from what a real one answered
//! (`tests/fixtures/vllm-0.32-*`): its `/metrics` capture (KV gauges set per rank by the test),
//! `/version`, `/v1/models` (or a list the test sets), its chat completion, and its 400 for a
//! pin outside its ranks. As a
//! server that is its own DP deployment it labels and accepts ranks 0 and 1; as the second member
//! of a multi-server deployment (`first_rank = 2`) it labels and accepts 2 and 3, as vLLM's
//! hybrid DP numbers them.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use rankgate::app::Router;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The longest a test here waits for the router to see something.
pub const WAIT: std::time::Duration = std::time::Duration::from_secs(10);

const METRICS: &str = include_str!("../../../tests/fixtures/vllm-0.32-dp2-metrics.txt");
const CHAT: &str = include_str!("../../../tests/fixtures/vllm-0.32-chat.json");
const MODELS: &str = include_str!("../../../tests/fixtures/vllm-0.32-models.json");

#[derive(Default)]
struct State {
    first_rank: u32,
    /// Per rank, the KV usage its `/metrics` reports (f64 bits).
    kv: [AtomicU64; 2],
    /// Every `X-data-parallel-rank` a chat arrived with, in order.
    pins: Mutex<Vec<String>>,
    /// Chats refused with vLLM's 400 for a rank it does not run.
    refused: AtomicU64,
    /// Its `/v1/models` answer, when the test set one (else the capture's).
    models: Mutex<Option<String>>,
    /// `/v1/models` reads.
    model_reads: AtomicU64,
    /// `POST /v1/load_lora_adapter` calls: each answered as vLLM answers a load, though the
    /// model list it serves does not change (an engine that says so and does not).
    lora_loads: AtomicU64,
}

pub struct RecordedVllm {
    pub addr: SocketAddr,
    state: Arc<State>,
    accept: JoinHandle<()>,
}

impl Drop for RecordedVllm {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl RecordedVllm {
    /// An independent server (ranks 0 and 1) on 127.0.0.1:0.
    pub async fn start() -> RecordedVllm {
        Self::start_on(super::loopback(), 0)
            .await
            .expect("bind 127.0.0.1:0")
    }

    /// A server on `addr` whose ranks are `first_rank` and `first_rank + 1`.
    pub async fn start_on(addr: SocketAddr, first_rank: u32) -> std::io::Result<RecordedVllm> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            first_rank,
            ..State::default()
        });
        let s = state.clone();
        let accept = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let s = s.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| answer(req, s.clone()));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        Ok(RecordedVllm {
            addr,
            state,
            accept,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Sets the KV usage its `/metrics` reports for its first and second rank.
    pub fn set_kv(&self, kv: [f64; 2]) {
        for (slot, v) in self.state.kv.iter().zip(kv) {
            slot.store(v.to_bits(), Relaxed);
        }
    }

    /// The rank headers of the chats it served, in order.
    pub fn pins(&self) -> Vec<String> {
        self.state.pins.lock().unwrap().clone()
    }

    /// From now on its `/v1/models` answers `body` (e.g. a capture with adapters loaded).
    pub fn set_models(&self, body: &str) {
        *self.state.models.lock().unwrap() = Some(body.to_string());
    }

    /// How many times its `/v1/models` was read.
    pub fn model_reads(&self) -> u64 {
        self.state.model_reads.load(Relaxed)
    }

    /// How many LoRA adapter loads it was asked for.
    pub fn lora_loads(&self) -> u64 {
        self.state.lora_loads.load(Relaxed)
    }

    /// How many chats it refused for naming a rank it does not run.
    pub fn refused(&self) -> u64 {
        self.state.refused.load(Relaxed)
    }
}

/// The capture with its ranks relabelled from `first` and its KV gauges set.
fn metrics(s: &State) -> String {
    let kv = |i: usize| f64::from_bits(s.kv[i].load(Relaxed));
    METRICS
        .lines()
        .map(|line| {
            let mut line = line.to_string();
            for i in [1u32, 0] {
                let label = format!("engine=\"{i}\"");
                if !line.contains(&label) {
                    continue;
                }
                if line.starts_with("vllm:kv_cache_usage_perc{") {
                    let head = line.rsplit_once(' ').map_or(line.as_str(), |(h, _)| h);
                    line = format!("{head} {}", kv(i as usize));
                }
                line = line.replace(&label, &format!("engine=\"{}\"", s.first_rank + i));
            }
            line + "\n"
        })
        .collect()
}

fn reply(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    r
}

async fn answer(
    req: Request<Incoming>,
    s: Arc<State>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let ok = |body: String| Ok(reply(StatusCode::OK, body));
    match (req.method().as_str(), req.uri().path()) {
        ("GET", "/metrics") => ok(metrics(&s)),
        ("GET", "/version") => ok(r#"{"version":"0.32.0"}"#.into()),
        ("GET", "/health") => ok(String::new()),
        ("GET", "/v1/models") => {
            s.model_reads.fetch_add(1, Relaxed);
            let set = s.models.lock().unwrap().clone();
            ok(set.unwrap_or_else(|| MODELS.into()))
        }
        ("POST", "/v1/chat/completions") => {
            let pin = req
                .headers()
                .get("x-data-parallel-rank")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let ranks = s.first_rank..s.first_rank + 2;
            match pin.parse::<u32>() {
                Ok(r) if !ranks.contains(&r) => {
                    s.refused.fetch_add(1, Relaxed);
                    // vLLM's own words for a rank outside its range.
                    let body = format!(
                        r#"{{"error":{{"message":"data_parallel_rank {r} is out of range [{}, {}).","type":"BadRequestError","param":null,"code":400}}}}"#,
                        ranks.start, ranks.end
                    );
                    Ok(reply(StatusCode::BAD_REQUEST, body))
                }
                _ => {
                    s.pins.lock().unwrap().push(pin);
                    ok(CHAT.into())
                }
            }
        }
        ("POST", "/v1/load_lora_adapter") => {
            s.lora_loads.fetch_add(1, Relaxed);
            ok("Success: LoRA adapter added successfully.".into())
        }
        // FastAPI's answer for a route vLLM does not have (`/get_server_info` among them).
        _ => Ok(reply(StatusCode::NOT_FOUND, r#"{"detail":"Not Found"}"#)),
    }
}

/// Waits until `/workers` shows each id's KV usage as given.
pub async fn kv_shown(r: &Router, want: &[(String, f64)]) {
    super::wait_workers(r, WAIT, |rows| {
        want.iter().all(|(id, kv)| {
            rows.iter()
                .any(|w| w["id"] == id.as_str() && w["kv_usage"].as_f64() == Some(*kv))
        })
    })
    .await;
}

/// Three servers of two ranks each: six workers `url@0`/`url@1`, all available; each request goes
/// to the least-KV rank of the six and is pinned with that server's own rank number.
pub async fn six_ranks_least_kv(r: &Router, e: &[RecordedVllm; 3]) {
    let mut ids = super::wait_available(r, |ids| ids.len() == 6).await;
    ids.sort();
    let mut want: Vec<String> = (e.iter())
        .flat_map(|s| [format!("{}@0", s.url()), format!("{}@1", s.url())])
        .collect();
    want.sort();
    assert_eq!(ids, want);
    // Every server's model list read, so none is left out of the pick for want of it.
    super::wait_workers(r, WAIT, |rows| {
        rows.iter()
            .all(|w| w["models"] == serde_json::json!(["tiny-llama"]))
    })
    .await;

    let kv = |s: &RecordedVllm, k: [f64; 2]| {
        s.set_kv(k);
        [
            (format!("{}@0", s.url()), k[0]),
            (format!("{}@1", s.url()), k[1]),
        ]
    };
    let shown: Vec<_> = [
        kv(&e[0], [0.5, 0.4]),
        kv(&e[1], [0.3, 0.6]),
        kv(&e[2], [0.7, 0.1]),
    ]
    .concat();
    kv_shown(r, &shown).await;
    for _ in 0..3 {
        let reply = super::chat(r.addr, 2).await;
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        assert_eq!(reply.worker(), format!("{}@1", e[2].url()));
    }
    assert_eq!(e[2].pins(), ["1", "1", "1"], "pinned to its own rank 1");

    // Now the second server's first rank is the idlest of the six.
    let shown: Vec<_> = [kv(&e[1], [0.05, 0.6]), kv(&e[2], [0.7, 0.9])].concat();
    kv_shown(r, &shown).await;
    for _ in 0..3 {
        let reply = super::chat(r.addr, 2).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.worker(), format!("{}@0", e[1].url()));
    }
    assert_eq!(e[1].pins(), ["0", "0", "0"]);
    assert!(e[0].pins().is_empty());
    for s in e {
        assert_eq!(
            s.refused(),
            0,
            "no request named a rank the server does not run"
        );
    }
}
