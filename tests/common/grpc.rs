//! gRPC clients for the engines' services (vLLM's `VllmEngine`, SGLang's `SglangScheduler`) over
//! real sockets: the generated tonic clients behind one flavor-neutral [`Client`], usable against
//! a simulated engine's gRPC side and rankgate's gRPC front door alike, and [`raw_call`] for what
//! a generated client cannot send (unknown fields, methods the protos do not list).

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, Request, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use prost::Message;
use rankgate::app::Router;
use rankgate::proto::{sglang, vllm};
use rankgate::telemetry::grpc::{transport, Transport};
use rankgate_sim::sim::{SimEngine, SimFlavor as Flavor};
use tonic::{Code, Status, Streaming};

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

pub enum Client {
    Vllm(vllm::vllm_engine_client::VllmEngineClient<Transport>),
    Sglang(sglang::sglang_scheduler_client::SglangSchedulerClient<Transport>),
}

/// A generation event, whichever flavor framed it.
#[derive(Debug, PartialEq)]
pub enum Ev {
    Chunk { completion: u32 },
    Complete { reason: String, tokens: usize },
}

pub enum Gen {
    Vllm(Streaming<vllm::GenerateResponse>),
    Sglang(Streaming<sglang::GenerateResponse>),
}

impl Gen {
    /// The next event; `None` once the stream ended with status OK (any other status panics).
    pub async fn next(&mut self) -> Option<Ev> {
        self.try_next().await.expect("stream")
    }

    /// The next event; `Ok(None)` once the stream ended with status OK, `Err` with any other
    /// status (in the trailers, or a transport error as tonic reports it).
    pub async fn try_next(&mut self) -> Result<Option<Ev>, Status> {
        Ok(match self {
            Gen::Vllm(s) => {
                let Some(m) = bounded(s.message()).await? else {
                    return Ok(None);
                };
                Some(match m.response.expect("a response") {
                    vllm::generate_response::Response::Chunk(c) => Ev::Chunk {
                        completion: c.completion_tokens,
                    },
                    vllm::generate_response::Response::Complete(c) => Ev::Complete {
                        reason: c.finish_reason,
                        tokens: c.output_ids.len(),
                    },
                })
            }
            Gen::Sglang(s) => {
                let Some(m) = bounded(s.message()).await? else {
                    return Ok(None);
                };
                Some(match m.response.expect("a response") {
                    sglang::generate_response::Response::Chunk(c) => Ev::Chunk {
                        completion: c.completion_tokens,
                    },
                    sglang::generate_response::Response::Complete(c) => Ev::Complete {
                        reason: c.finish_reason,
                        tokens: c.output_ids.len(),
                    },
                    sglang::generate_response::Response::Error(e) => panic!("error {e:?}"),
                })
            }
        })
    }

    /// Every event until the stream ends (at most `limit`, or it panics).
    pub async fn all(&mut self, limit: usize) -> Vec<Ev> {
        let mut events = Vec::new();
        while let Some(ev) = self.next().await {
            events.push(ev);
            assert!(events.len() <= limit, "too many events: {events:?}");
        }
        events
    }

    /// Skips chunks until the final message: its finish reason and token count (`None`: the
    /// stream ended without one). Bounded by the per-message timeout and 10k chunks.
    pub async fn until_complete(&mut self) -> Option<(String, usize)> {
        for _ in 0..10_000 {
            match self.next().await? {
                Ev::Chunk { .. } => {}
                Ev::Complete { reason, tokens } => return Some((reason, tokens)),
            }
        }
        panic!("no final message within 10000 chunks");
    }
}

/// A generation as started: its stream, the request message as encoded by the client, and the
/// `x-rankgate-worker` response metadata (when rankgate answered).
pub struct Started {
    pub stream: Gen,
    pub raw: Vec<u8>,
    pub worker: Option<String>,
}

/// What `GetLoads` answered: `dp_rank_count` and per entry `(dp_rank, token_usage)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Loads {
    pub dp_rank_count: i32,
    pub ranks: Vec<(i32, f64)>,
}

fn worker_of(m: &tonic::metadata::MetadataMap) -> Option<String> {
    m.get("x-rankgate-worker")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

impl Client {
    /// A client of `flavor`'s service at `addr` (an engine's gRPC side or rankgate's).
    pub fn connect(flavor: Flavor, addr: SocketAddr) -> Client {
        let origin: http::Uri = format!("http://{addr}").parse().unwrap();
        let t = transport(Duration::from_secs(2));
        match flavor {
            Flavor::Vllm => Client::Vllm(vllm::vllm_engine_client::VllmEngineClient::with_origin(
                t, origin,
            )),
            Flavor::Sglang => Client::Sglang(
                sglang::sglang_scheduler_client::SglangSchedulerClient::with_origin(t, origin),
            ),
        }
    }

    pub fn flavor(&self) -> Flavor {
        match self {
            Client::Vllm(_) => Flavor::Vllm,
            Client::Sglang(_) => Flavor::Sglang,
        }
    }

    /// Starts a streaming generation; returns the stream, the request's encoded bytes and the
    /// worker metadata.
    pub async fn start(
        &mut self,
        id: &str,
        rank: Option<i32>,
        max: u32,
    ) -> Result<Started, Status> {
        match self {
            Client::Vllm(c) => {
                let req = vllm_generate(id, rank, max);
                let raw = req.encode_to_vec();
                let resp = bounded(c.generate(tonic::Request::new(req))).await?;
                Ok(Started {
                    worker: worker_of(resp.metadata()),
                    stream: Gen::Vllm(resp.into_inner()),
                    raw,
                })
            }
            Client::Sglang(c) => {
                let req = sglang_generate(id, rank, max);
                let raw = req.encode_to_vec();
                let resp = bounded(c.generate(tonic::Request::new(req))).await?;
                Ok(Started {
                    worker: worker_of(resp.metadata()),
                    stream: Gen::Sglang(resp.into_inner()),
                    raw,
                })
            }
        }
    }

    /// Starts a streaming generation; returns the stream and the request's encoded bytes.
    pub async fn generate(
        &mut self,
        id: &str,
        rank: Option<i32>,
        max: u32,
    ) -> Result<(Gen, Vec<u8>), Status> {
        let s = self.start(id, rank, max).await?;
        Ok((s.stream, s.raw))
    }

    /// One embedding (the rank is sent by SGLang only: vLLM's request has no rank); its dimension.
    pub async fn embed(&mut self, id: &str, rank: i32) -> Result<usize, Status> {
        match self {
            Client::Vllm(c) => {
                let r = bounded(c.embed(vllm_embed(id))).await?.into_inner();
                assert_eq!(r.embedding_dim as usize, r.embedding.len());
                Ok(r.embedding.len())
            }
            Client::Sglang(c) => {
                let r = bounded(c.embed(sglang_embed(id, rank))).await?.into_inner();
                assert_eq!(r.request_id, id);
                match r.response.expect("a response") {
                    sglang::embed_response::Response::Complete(c) => {
                        assert_eq!(c.embedding_dim as usize, c.embedding.len());
                        assert_eq!(c.prompt_tokens, 3);
                        Ok(c.embedding.len())
                    }
                    sglang::embed_response::Response::Error(e) => panic!("error {e:?}"),
                }
            }
        }
    }

    /// Aborts `id`. Returns SGLang's `AbortResponse.success` (vLLM's answer has no field: `None`).
    pub async fn abort(&mut self, id: &str) -> Result<Option<bool>, Status> {
        match self {
            Client::Vllm(c) => {
                let req = vllm::AbortRequest {
                    request_ids: vec![id.into()],
                };
                bounded(c.abort(req)).await?;
                Ok(None)
            }
            Client::Sglang(c) => {
                let req = sglang::AbortRequest {
                    request_id: id.into(),
                    reason: String::new(),
                };
                Ok(Some(bounded(c.abort(req)).await?.into_inner().success))
            }
        }
    }

    /// `GetLoads`, for every rank or only `dp_rank`.
    pub async fn get_loads(&mut self, dp_rank: Option<i32>) -> Result<Loads, Status> {
        match self {
            Client::Vllm(c) => {
                let req = vllm::GetLoadsRequest {
                    dp_rank,
                    include: vec![],
                };
                let r = bounded(c.get_loads(req)).await?.into_inner();
                Ok(Loads {
                    dp_rank_count: r.dp_rank_count,
                    ranks: r.loads.iter().map(|l| (l.dp_rank, l.token_usage)).collect(),
                })
            }
            Client::Sglang(c) => {
                let req = sglang::GetLoadsRequest {
                    dp_rank,
                    include: vec![],
                };
                let r = bounded(c.get_loads(req)).await?.into_inner();
                Ok(Loads {
                    dp_rank_count: r.dp_rank_count,
                    ranks: r.loads.iter().map(|l| (l.dp_rank, l.token_usage)).collect(),
                })
            }
        }
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

/// One message in a gRPC frame (uncompressed).
pub fn frame(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(message.len() + 5);
    out.put_u8(0);
    out.put_u32(message.len() as u32);
    out.put_slice(message);
    out.freeze()
}

/// A whole gRPC answer as read off the wire by [`raw_call`].
#[derive(Debug)]
pub struct RawReply {
    pub http: StatusCode,
    pub headers: HeaderMap,
    /// The response messages, unframed.
    pub messages: Vec<Bytes>,
    /// `grpc-status` (from the trailers, or the headers of a trailers-only answer).
    pub code: Code,
    /// `grpc-message`, percent-decoded.
    pub message: String,
}

impl RawReply {
    pub fn worker(&self) -> Option<&str> {
        self.headers
            .get("x-rankgate-worker")
            .and_then(|v| v.to_str().ok())
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (b[i], hex) {
            (b'%', Some(v)) => {
                out.push(v);
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One unary-request gRPC call as raw h2c: `message` (any bytes) framed and POSTed to `path`
/// with the gRPC headers; the whole answer (every message, status) read within the timeout.
pub async fn raw_call(addr: SocketAddr, path: &str, message: &[u8]) -> RawReply {
    raw_call_with(addr, path, message, &[]).await
}

/// [`raw_call`] with extra request metadata.
pub async fn raw_call_with(
    addr: SocketAddr,
    path: &str,
    message: &[u8],
    metadata: &[(&str, &str)],
) -> RawReply {
    let mut req = grpc_request(addr, path);
    for (k, v) in metadata {
        req = req.header(*k, *v);
    }
    raw_request(req.body(Full::new(frame(message))).unwrap()).await
}

/// A gRPC call's request head as a client sends it over h2c: POST to `path` with the gRPC
/// content-type and `te: trailers`.
pub fn grpc_request(addr: SocketAddr, path: &str) -> http::request::Builder {
    Request::post(format!("http://{addr}{path}"))
        .version(Version::HTTP_2)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
}

/// Sends `req` over h2c, whatever its body (bytes that are no gRPC frame included), and reads
/// the whole answer within the timeout.
pub async fn raw_request<B>(req: Request<B>) -> RawReply
where
    B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let client = rankgate::http::h2_client::<B>(Duration::from_secs(2));
    let resp = bounded(client.request(req)).await.expect("h2 request");
    read_reply(resp).await
}

/// The whole answer to a raw request (HTTP/2 or HTTP/1.1): messages and gRPC status.
pub async fn read_reply(resp: http::Response<hyper::body::Incoming>) -> RawReply {
    let (parts, body) = resp.into_parts();
    let all = bounded(body.collect()).await.expect("response body");
    let trailers = all.trailers().cloned().unwrap_or_default();
    let mut body = all.to_bytes();
    let mut messages = Vec::new();
    while body.has_remaining() {
        assert!(body.len() >= 5, "a cut frame header: {body:?}");
        assert_eq!(body.get_u8(), 0, "a compressed response message");
        let len = body.get_u32() as usize;
        assert!(body.len() >= len, "a cut message");
        messages.push(body.split_to(len));
    }
    let status = match trailers.contains_key("grpc-status") {
        true => &trailers,
        false => &parts.headers,
    };
    let code = status
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
        .map_or(Code::Unknown, Code::from_i32);
    let message = status
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .map(percent_decode)
        .unwrap_or_default();
    RawReply {
        http: parts.status,
        headers: parts.headers,
        messages,
        code,
        message,
    }
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
