//! gRPC clients for the engines' services (vLLM's `VllmEngine`, SGLang's `SglangScheduler`) over
//! real sockets: the generated tonic clients behind one flavor-neutral [`Client`], usable against
//! a simulated engine's gRPC side and rankgate's gRPC front door alike, and [`raw_call`] for what
//! a generated client cannot send (unknown fields, methods the protos do not list).

mod client;
mod raw;

pub use client::*;
pub use raw::*;

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use prost::Message;
use rankgate::app::Router;
use rankgate::proto::{sglang, vllm};
use rankgate_sim::sim::{SimEngine, SimFlavor as Flavor};

use super::{engine, loopback, router, wait_state, wait_workers};

pub const FLAVORS: [Flavor; 2] = [Flavor::Vllm, Flavor::Sglang];

/// Everything here answers within this; a test that waits longer has failed.
pub async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .expect("timed out")
}

/// The flavor's gRPC service, as it appears in method paths.
pub fn service(flavor: Flavor) -> &'static str {
    match flavor {
        Flavor::Vllm => "vllm.grpc.engine.VllmEngine",
        Flavor::Sglang => "sglang.grpc.scheduler.SglangScheduler",
    }
}

/// `/service/method` for the flavor's service.
pub fn method_path(flavor: Flavor, method: &str) -> String {
    format!("/{}/{method}", service(flavor))
}

/// The number of `GenerateRequest.data_parallel_rank` in the flavor's proto.
pub fn generate_rank_field(flavor: Flavor) -> u64 {
    match flavor {
        Flavor::Vllm => 9,
        Flavor::Sglang => 16,
    }
}

pub fn vllm_generate(id: &str, rank: Option<i32>, max: u32) -> vllm::GenerateRequest {
    vllm::GenerateRequest {
        request_id: id.into(),
        input: Some(vllm::generate_request::Input::Tokenized(
            vllm::TokenizedInput {
                original_text: "hi".into(),
                input_ids: vec![1, 2, 3, 4],
            },
        )),
        sampling_params: Some(vllm::SamplingParams {
            max_tokens: Some(max),
        }),
        stream: true,
        data_parallel_rank: rank,
    }
}

pub fn sglang_generate(id: &str, rank: Option<i32>, max: u32) -> sglang::GenerateRequest {
    sglang::GenerateRequest {
        request_id: id.into(),
        tokenized: Some(sglang::TokenizedInput {
            original_text: "hi".into(),
            input_ids: vec![1, 2, 3, 4],
        }),
        sampling_params: Some(sglang::SamplingParams {
            max_new_tokens: Some(max),
        }),
        data_parallel_rank: rank,
        stream: true,
    }
}

/// A streaming `GenerateRequest` of the flavor, encoded.
pub fn generate_bytes(flavor: Flavor, id: &str, rank: Option<i32>, max: u32) -> Vec<u8> {
    match flavor {
        Flavor::Vllm => vllm_generate(id, rank, max).encode_to_vec(),
        Flavor::Sglang => sglang_generate(id, rank, max).encode_to_vec(),
    }
}

pub fn vllm_embed(id: &str) -> vllm::EmbedRequest {
    vllm::EmbedRequest {
        request_id: id.into(),
        tokenized: Some(vllm::TokenizedInput {
            original_text: String::new(),
            input_ids: vec![5, 6, 7],
        }),
    }
}

/// SGLang's rank is a plain `int32`: 0 is not on the wire.
pub fn sglang_embed(id: &str, rank: i32) -> sglang::EmbedRequest {
    sglang::EmbedRequest {
        request_id: id.into(),
        tokenized: Some(sglang::TokenizedInput {
            original_text: String::new(),
            input_ids: vec![5, 6, 7],
        }),
        data_parallel_rank: rank,
    }
}

/// An `EmbedRequest` of the flavor, encoded (the rank is SGLang's only).
pub fn embed_bytes(flavor: Flavor, id: &str, rank: i32) -> Vec<u8> {
    match flavor {
        Flavor::Vllm => vllm_embed(id).encode_to_vec(),
        Flavor::Sglang => sglang_embed(id, rank).encode_to_vec(),
    }
}

/// Waits (bounded) until no rank runs anything and no request is open.
pub async fn wait_idle(e: &SimEngine) {
    for _ in 0..200 {
        if e.running().iter().all(|&n| n == 0) && e.open_requests() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!(
        "still busy: running {:?}, open {}",
        e.running(),
        e.open_requests()
    );
}

/// The gRPC listener on an ephemeral port; telemetry polled every 50 ms, fresh for 2 s.
pub const GRPC_FAST: &str =
    "grpc_listen = \"127.0.0.1:0\"\n[telemetry]\ninterval = \"50ms\"\nstale_after = \"2s\"\n";

/// A simulated engine with its gRPC side started; rankgate knows it by `grpc_url` only.
pub struct Eng {
    pub sim: SimEngine,
    pub grpc: SocketAddr,
    pub flavor: Flavor,
    pub dp_size: u32,
    pub start_rank: u32,
}

impl Eng {
    pub async fn start(flavor: Flavor, dp_size: u32, start_rank: u32) -> Eng {
        let sim = engine(super::sim(flavor, dp_size, start_rank)).await;
        let grpc = sim.start_grpc(loopback()).await.expect("start gRPC");
        Eng {
            sim,
            grpc,
            flavor,
            dp_size,
            start_rank,
        }
    }

    /// Its `grpc_url`, which is also its identity in rankgate (it has no `url`).
    pub fn url(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// The `x-rankgate-worker` value of one of its ranks.
    pub fn worker(&self, rank: u32) -> String {
        format!("{}@{rank}", self.url())
    }

    pub fn toml(&self) -> String {
        grpc_toml(self.grpc, self.flavor, self.dp_size, self.start_rank)
    }

    /// Whether it received a `Generate` call.
    pub fn generated(&self) -> bool {
        self.sim.grpc_seen().iter().any(|s| s.method == "Generate")
    }
}

/// One `[[engines]]` table with only `grpc_url`.
pub fn grpc_toml(grpc: SocketAddr, flavor: Flavor, dp_size: u32, start_rank: u32) -> String {
    format!(
        "[[engines]]\ngrpc_url = \"http://{grpc}\"\nflavor = \"{}\"\ndp_size = {dp_size}\nstart_rank = {start_rank}\n",
        flavor.as_str()
    )
}

/// rankgate with its gRPC listener, in front of these engines.
pub async fn grpc_router(engines: &[&Eng]) -> Router {
    let tables: Vec<String> = engines.iter().map(|e| e.toml()).collect();
    router(GRPC_FAST, &tables).await
}

/// rankgate with its gRPC listener and these extra `[server]` keys (`key = value` lines), in
/// front of these `[[engines]]` tables.
pub async fn grpc_router_with(server_keys: &str, engines: &[String]) -> Router {
    router(&format!("{server_keys}\n{GRPC_FAST}"), engines).await
}

/// A client of rankgate's gRPC front door.
pub fn front(r: &Router, flavor: Flavor) -> Client {
    Client::connect(flavor, r.grpc_addr.expect("grpc_listen is set"))
}

/// Waits until `/workers` shows these KV usages (worker index, usage).
pub async fn wait_kv(r: &Router, want: &[(usize, f64)]) {
    wait_workers(r, Duration::from_secs(10), |rows| {
        want.iter().all(|&(i, kv)| {
            rows[i]["kv_usage"]
                .as_f64()
                .is_some_and(|v| (v - kv).abs() < 1e-9)
        })
    })
    .await;
}

/// Waits until rankgate holds nothing in flight on any rank.
pub async fn wait_no_in_flight(r: &Router) {
    wait_workers(r, Duration::from_secs(10), |rows| {
        rows.iter().all(|w| w["in_flight"] == 0)
    })
    .await;
}

/// A stream of `n` chunks then `Complete` with reason `length`.
pub fn complete(n: u32) -> Vec<Ev> {
    let mut want: Vec<Ev> = (1..=n).map(|completion| Ev::Chunk { completion }).collect();
    want.push(Ev::Complete {
        reason: "length".into(),
        tokens: n as usize,
    });
    want
}

/// A port on 127.0.0.1 where nothing listens (bound, then released).
pub async fn refusing_port() -> SocketAddr {
    let l = tokio::net::TcpListener::bind(loopback()).await.unwrap();
    l.local_addr().unwrap()
}

/// Two engines of one rank each (ranks 0 and 1) behind rankgate, both available.
pub async fn two_engines(flavor: Flavor) -> (Eng, Eng, Router) {
    let a = Eng::start(flavor, 1, 0).await;
    let b = Eng::start(flavor, 1, 1).await;
    let r = grpc_router(&[&a, &b]).await;
    wait_state(&r, &[0, 1], "available").await;
    (a, b, r)
}
