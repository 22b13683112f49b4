//! The simulated engine's gRPC side: `Generate`, `Embed` and `Abort` (run by `grpc_decode`),
//! `GetLoads` (and vLLM's `GetServerInfo`) with the servicer semantics, plus the standard health
//! service, served over h2c by the simulator's accept loop so that it dies with the engine.
//!
//! The accept loop reads each request body whole before tonic sees it, to keep the message's raw
//! bytes for [`super::GrpcSeen`]: every RPC served here sends one request message, so nothing
//! waits on a client stream.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use tonic::codegen::tokio_stream::{wrappers::ReceiverStream, StreamExt};
use tonic::codegen::BoxStream;
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status};
use tower::ServiceExt;

use super::grpc_decode::{
    first_message, prompt_bytes, prompt_tokens, Gen, GenJob, RawMessage, EMBED_DIM,
};
use super::{net, RankReport, Sim, SimFlavor, MAX_REQUEST_BYTES};
use rankgate::http::Shutdown;
use rankgate::proto::health::health_server::{Health, HealthServer};
use rankgate::proto::health::{
    health_check_response::ServingStatus, HealthCheckRequest, HealthCheckResponse,
};
use rankgate::proto::sglang::sglang_scheduler_server::{SglangScheduler, SglangSchedulerServer};
use rankgate::proto::vllm::vllm_engine_server::{VllmEngine, VllmEngineServer};
use rankgate::proto::{sglang, vllm};

#[derive(Clone)]
pub(crate) struct GrpcSim(pub Arc<Sim>);

impl GrpcSim {
    async fn entries(&self, dp_rank: Option<i32>) -> Result<Vec<RankReport>, Status> {
        self.0.telemetry_requests.fetch_add(1, Relaxed);
        if self.0.faults.hang_metrics.load(Relaxed) {
            // The client's deadline or a shutdown ends the wait; either way nothing is reported.
            self.0.hold().await;
            return Err(Status::unavailable("engine shutting down"));
        }
        if self.0.native_failing() {
            return Err(Status::unavailable("loads unavailable"));
        }
        self.0
            .loads_for(dp_rank.map(i64::from))
            .map_err(Status::invalid_argument)
    }
}

impl GrpcSim {
    /// The engine's request faults, as its HTTP side applies them: the failing share answers
    /// at once with the configured status's gRPC counterpart, a hanging engine never answers.
    async fn injected(&self) -> Result<(), Status> {
        let faults = &self.0.faults;
        faults.received.fetch_add(1, Relaxed);
        if let Some(status) = faults.failing() {
            let msg = format!("injected failure (HTTP {status})");
            return Err(match status.as_u16() {
                429 => Status::resource_exhausted(msg),
                503 => Status::unavailable(msg),
                504 => Status::deadline_exceeded(msg),
                400..=499 => Status::invalid_argument(msg),
                _ => Status::internal(msg),
            });
        }
        if faults.hang_requests.load(Relaxed) {
            self.0.hold().await;
            return Err(Status::unavailable("engine shutting down"));
        }
        Ok(())
    }
}

/// The raw request message and call facts the accept loop kept.
fn raw<T>(req: &GrpcRequest<T>) -> RawMessage {
    req.extensions()
        .get::<RawMessage>()
        .cloned()
        .unwrap_or(RawMessage {
            raw: Bytes::new(),
            timeout: None,
            peer: None,
            header_names: Vec::new(),
        })
}

fn u32_of(n: u64) -> u32 {
    n.min(u32::MAX as u64) as u32
}

fn clamp(n: i64) -> i32 {
    n.clamp(i32::MIN as i64, i32::MAX as i64) as i32
}

// The two services' entries differ only in one field number, so one body builds both.
macro_rules! from_report {
    ($ty:ty) => {
        impl From<&RankReport> for $ty {
            fn from(e: &RankReport) -> Self {
                Self {
                    dp_rank: e.global as i32,
                    num_running_reqs: clamp(e.running),
                    num_waiting_reqs: clamp(e.waiting),
                    num_total_reqs: clamp(e.running + e.waiting),
                    num_used_tokens: clamp(e.used_tokens),
                    max_total_num_tokens: clamp(e.capacity),
                    token_usage: e.usage,
                    ..Default::default()
                }
            }
        }
    };
}
from_report!(vllm::SchedulerLoad);
from_report!(sglang::SchedulerLoad);

#[tonic::async_trait]
impl VllmEngine for GrpcSim {
    type GenerateStream = BoxStream<vllm::GenerateResponse>;

    async fn generate(
        &self,
        req: GrpcRequest<vllm::GenerateRequest>,
    ) -> Result<GrpcResponse<Self::GenerateStream>, Status> {
        self.injected().await?;
        let raw = raw(&req);
        let r = req.into_inner();
        let local = self.0.grpc_rank(r.data_parallel_rank)?;
        self.0.record_grpc("Generate", Some(local), raw);
        let (prompt, bytes) = match &r.input {
            Some(vllm::generate_request::Input::Tokenized(t)) => (
                prompt_tokens(t.input_ids.len(), &t.original_text),
                prompt_bytes(&t.input_ids, &t.original_text),
            ),
            Some(vllm::generate_request::Input::Text(t)) => {
                (prompt_tokens(0, t), prompt_bytes(&[], t))
            }
            None => (prompt_tokens(0, ""), Vec::new()),
        };
        let max_tokens = r.sampling_params.and_then(|p| p.max_tokens).unwrap_or(16);
        let job = GenJob {
            id: r.request_id,
            local,
            prompt_tokens: prompt,
            blocks: self.0.prompt_blocks(&bytes, prompt),
            max_tokens: u64::from(max_tokens.max(1)),
            stream: r.stream,
        };
        let p = u32_of(prompt);
        let events = self.0.clone().generate(job);
        let stream = ReceiverStream::new(events).map(move |g| {
            use vllm::generate_response::Response as R;
            let response = match g {
                Gen::Chunk { token, completion } => R::Chunk(vllm::GenerateStreamChunk {
                    token_ids: vec![token],
                    prompt_tokens: p,
                    completion_tokens: completion,
                    cached_tokens: 0,
                }),
                Gen::Complete { output, reason } => R::Complete(vllm::GenerateComplete {
                    completion_tokens: output.len() as u32,
                    output_ids: output,
                    finish_reason: reason.into(),
                    prompt_tokens: p,
                    cached_tokens: 0,
                }),
            };
            Ok(vllm::GenerateResponse {
                response: Some(response),
            })
        });
        Ok(GrpcResponse::new(Box::pin(stream)))
    }

    async fn embed(
        &self,
        req: GrpcRequest<vllm::EmbedRequest>,
    ) -> Result<GrpcResponse<vllm::EmbedResponse>, Status> {
        self.injected().await?;
        let raw = raw(&req);
        let r = req.into_inner();
        // vLLM's embedding request carries no rank: the engine always balances it.
        let local = self.0.grpc_rank(None)?;
        self.0.record_grpc("Embed", Some(local), raw);
        let prompt = r
            .tokenized
            .map_or(1, |t| prompt_tokens(t.input_ids.len(), &t.original_text));
        let embedding = self.0.embed(local, prompt).await;
        Ok(GrpcResponse::new(vllm::EmbedResponse {
            embedding,
            prompt_tokens: u32_of(prompt),
            embedding_dim: EMBED_DIM as u32,
        }))
    }

    async fn abort(
        &self,
        req: GrpcRequest<vllm::AbortRequest>,
    ) -> Result<GrpcResponse<vllm::AbortResponse>, Status> {
        self.0.record_grpc("Abort", None, raw(&req));
        let r = req.into_inner();
        self.0.abort(r.request_ids.iter().map(String::as_str));
        Ok(GrpcResponse::new(vllm::AbortResponse {}))
    }

    async fn get_server_info(
        &self,
        _: GrpcRequest<vllm::GetServerInfoRequest>,
    ) -> Result<GrpcResponse<vllm::GetServerInfoResponse>, Status> {
        let cfg = &self.0.cfg;
        Ok(GrpcResponse::new(vllm::GetServerInfoResponse {
            active_requests: self.0.ranks.iter().map(|r| r.counts().running).sum(),
            server_type: "vllm-grpc".into(),
            data_parallel_size: cfg.deployment_size() as i32,
        }))
    }

    async fn get_loads(
        &self,
        req: GrpcRequest<vllm::GetLoadsRequest>,
    ) -> Result<GrpcResponse<vllm::GetLoadsResponse>, Status> {
        let loads: Vec<_> = self
            .entries(req.into_inner().dp_rank)
            .await?
            .iter()
            .map(vllm::SchedulerLoad::from)
            .collect();
        Ok(GrpcResponse::new(vllm::GetLoadsResponse {
            timestamp: "1970-01-01T00:00:00Z".into(),
            version: "sim".into(),
            dp_rank_count: loads.len() as i32,
            loads,
        }))
    }
}

#[tonic::async_trait]
impl SglangScheduler for GrpcSim {
    type GenerateStream = BoxStream<sglang::GenerateResponse>;

    async fn generate(
        &self,
        req: GrpcRequest<sglang::GenerateRequest>,
    ) -> Result<GrpcResponse<Self::GenerateStream>, Status> {
        self.injected().await?;
        let raw = raw(&req);
        let r = req.into_inner();
        let local = self.0.grpc_rank(r.data_parallel_rank)?;
        self.0.record_grpc("Generate", Some(local), raw);
        let (prompt, bytes) = r.tokenized.as_ref().map_or((1, Vec::new()), |t| {
            (
                prompt_tokens(t.input_ids.len(), &t.original_text),
                prompt_bytes(&t.input_ids, &t.original_text),
            )
        });
        // SGLang's default bound, as on its HTTP `/generate`.
        let max_tokens = r
            .sampling_params
            .and_then(|p| p.max_new_tokens)
            .unwrap_or(128);
        let id = r.request_id;
        let job = GenJob {
            id: id.clone(),
            local,
            prompt_tokens: prompt,
            blocks: self.0.prompt_blocks(&bytes, prompt),
            max_tokens: u64::from(max_tokens.max(1)),
            stream: r.stream,
        };
        let p = u32_of(prompt);
        let events = self.0.clone().generate(job);
        let stream = ReceiverStream::new(events).map(move |g| {
            use sglang::generate_response::Response as R;
            let response = match g {
                Gen::Chunk { token, completion } => R::Chunk(sglang::GenerateStreamChunk {
                    token_ids: vec![token],
                    prompt_tokens: p,
                    completion_tokens: completion,
                    cached_tokens: 0,
                }),
                Gen::Complete { output, reason } => R::Complete(sglang::GenerateComplete {
                    completion_tokens: output.len() as u32,
                    output_ids: output,
                    finish_reason: reason.into(),
                    prompt_tokens: p,
                    cached_tokens: 0,
                }),
            };
            Ok(sglang::GenerateResponse {
                request_id: id.clone(),
                response: Some(response),
            })
        });
        Ok(GrpcResponse::new(Box::pin(stream)))
    }

    async fn embed(
        &self,
        req: GrpcRequest<sglang::EmbedRequest>,
    ) -> Result<GrpcResponse<sglang::EmbedResponse>, Status> {
        self.injected().await?;
        let raw = raw(&req);
        let r = req.into_inner();
        // A plain int32: rank 0 is not on the wire, so 0 reads as no pin.
        let pin = (r.data_parallel_rank != 0).then_some(r.data_parallel_rank);
        let local = self.0.grpc_rank(pin)?;
        self.0.record_grpc("Embed", Some(local), raw);
        let prompt = r
            .tokenized
            .map_or(1, |t| prompt_tokens(t.input_ids.len(), &t.original_text));
        let embedding = self.0.embed(local, prompt).await;
        Ok(GrpcResponse::new(sglang::EmbedResponse {
            request_id: r.request_id,
            response: Some(sglang::embed_response::Response::Complete(
                sglang::EmbedComplete {
                    embedding,
                    prompt_tokens: u32_of(prompt),
                    cached_tokens: 0,
                    embedding_dim: EMBED_DIM as u32,
                },
            )),
        }))
    }

    async fn abort(
        &self,
        req: GrpcRequest<sglang::AbortRequest>,
    ) -> Result<GrpcResponse<sglang::AbortResponse>, Status> {
        self.0.record_grpc("Abort", None, raw(&req));
        let r = req.into_inner();
        let found = self.0.abort([r.request_id.as_str()]);
        Ok(GrpcResponse::new(sglang::AbortResponse {
            success: true,
            message: if found > 0 {
                "aborted".into()
            } else {
                format!("request {} is not running", r.request_id)
            },
        }))
    }

    async fn get_loads(
        &self,
        req: GrpcRequest<sglang::GetLoadsRequest>,
    ) -> Result<GrpcResponse<sglang::GetLoadsResponse>, Status> {
        let loads: Vec<_> = self
            .entries(req.into_inner().dp_rank)
            .await?
            .iter()
            .map(sglang::SchedulerLoad::from)
            .collect();
        let n = loads.len().max(1) as f64;
        let aggregate = sglang::AggregateMetrics {
            total_running_reqs: loads.iter().map(|l| l.num_running_reqs).sum(),
            total_waiting_reqs: loads.iter().map(|l| l.num_waiting_reqs).sum(),
            total_reqs: loads.iter().map(|l| l.num_total_reqs).sum(),
            avg_token_usage: loads.iter().map(|l| l.token_usage).sum::<f64>() / n,
            ..Default::default()
        };
        Ok(GrpcResponse::new(sglang::GetLoadsResponse {
            timestamp: "1970-01-01T00:00:00Z".into(),
            version: "sim".into(),
            dp_rank_count: loads.len() as i32,
            loads,
            aggregate: Some(aggregate),
        }))
    }

    /// The server's arguments (only `dp_size` and `model_path` imitated), as a Struct.
    async fn get_server_info(
        &self,
        _: GrpcRequest<sglang::GetServerInfoRequest>,
    ) -> Result<GrpcResponse<sglang::GetServerInfoResponse>, Status> {
        use sglang::arg_value::Kind;
        let arg = |kind| sglang::ArgValue { kind: Some(kind) };
        let fields = [
            (
                "dp_size".to_string(),
                arg(Kind::NumberValue(f64::from(self.0.cfg.deployment_size()))),
            ),
            (
                "model_path".to_string(),
                arg(Kind::StringValue(self.0.default_model().to_string())),
            ),
        ];
        Ok(GrpcResponse::new(sglang::GetServerInfoResponse {
            server_args: Some(sglang::ServerArgs {
                fields: fields.into_iter().collect(),
            }),
            active_requests: self.0.ranks.iter().map(|r| r.counts().running).sum::<u32>() as i32,
            sglang_version: "sim".into(),
            server_type: "grpc".into(),
        }))
    }
}

#[tonic::async_trait]
impl Health for GrpcSim {
    async fn check(
        &self,
        _: GrpcRequest<HealthCheckRequest>,
    ) -> Result<GrpcResponse<HealthCheckResponse>, Status> {
        let status = if self.0.faults.health().is_success() {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        Ok(GrpcResponse::new(HealthCheckResponse {
            status: status as i32,
        }))
    }
}

/// Serves the engine's gRPC services on `listener` until `shutdown` or the engine dies.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    sim: Arc<Sim>,
    shutdown: Shutdown,
    running: net::Running,
) {
    let kill = sim.kill.subscribe();
    let grpc = GrpcSim(sim.clone());
    let health = HealthServer::new(grpc.clone());
    let vllm = VllmEngineServer::new(grpc.clone());
    let sglang = SglangSchedulerServer::new(grpc);
    let flavor = sim.cfg.flavor;
    let handler = move |req: Request<Incoming>| {
        let (health, vllm, sglang) = (health.clone(), vllm.clone(), sglang.clone());
        async move {
            let (mut parts, body) = req.into_parts();
            let body = match Limited::new(body, MAX_REQUEST_BYTES).collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => {
                    let status = Status::invalid_argument(format!("reading request: {e}"));
                    return Ok::<_, Infallible>(status.into_http());
                }
            };
            if let Some(raw) = first_message(&body) {
                let timeout = parts
                    .headers
                    .get("grpc-timeout")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                let peer = parts.extensions.get::<net::Peer>().map(|p| p.0);
                let header_names = parts.headers.keys().map(|k| k.to_string()).collect();
                parts.extensions.insert(RawMessage {
                    raw,
                    timeout,
                    peer,
                    header_names,
                });
            }
            let req = Request::from_parts(parts, Full::new(body));
            let resp: Response<tonic::body::Body> =
                if req.uri().path().starts_with("/grpc.health.v1.Health/") {
                    health.oneshot(req).await?
                } else {
                    match flavor {
                        SimFlavor::Vllm => vllm.oneshot(req).await?,
                        SimFlavor::Sglang => sglang.oneshot(req).await?,
                    }
                };
            Ok(resp)
        }
    };
    net::serve(listener, sim.tls.clone(), handler, shutdown, kill, running).await;
}

/// Binds the gRPC listener.
pub(crate) async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}
