//! The simulated engine's gRPC side: `GetLoads` (and vLLM's `GetServerInfo`) with the servicer
//! semantics, plus the standard health service, served over h2c by the simulator's accept loop so
//! that it dies with the engine.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status};
use tower::ServiceExt;

use super::{net, RankReport, Sim, SimFlavor};
use crate::http::Shutdown;
use crate::proto::health::health_server::{Health, HealthServer};
use crate::proto::health::{
    health_check_response::ServingStatus, HealthCheckRequest, HealthCheckResponse,
};
use crate::proto::sglang::sglang_scheduler_server::{SglangScheduler, SglangSchedulerServer};
use crate::proto::vllm::vllm_engine_server::{VllmEngine, VllmEngineServer};
use crate::proto::{sglang, vllm};

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
    async fn get_server_info(
        &self,
        _: GrpcRequest<vllm::GetServerInfoRequest>,
    ) -> Result<GrpcResponse<vllm::GetServerInfoResponse>, Status> {
        let cfg = &self.0.cfg;
        Ok(GrpcResponse::new(vllm::GetServerInfoResponse {
            active_requests: self.0.ranks.iter().map(|r| r.counts().running).sum(),
            server_type: "vllm-grpc".into(),
            data_parallel_size: (cfg.start_rank + cfg.dp_size) as i32,
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
            let resp: Response<tonic::body::Body> =
                if req.uri().path().starts_with("/grpc.health.v1.Health/") {
                    health.oneshot(req).await?
                } else {
                    match flavor {
                        SimFlavor::Vllm => vllm.oneshot(req).await?,
                        SimFlavor::Sglang => sglang.oneshot(req).await?,
                    }
                };
            Ok::<_, Infallible>(resp)
        }
    };
    net::serve(listener, handler, shutdown, kill, running).await;
}

/// Binds the gRPC listener.
pub(crate) async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}
