//! Code generated from `proto/` by `build.rs`: the vLLM and SGLang load services and gRPC health.

#![allow(clippy::all, missing_docs)]

pub mod vllm {
    tonic::include_proto!("vllm.grpc.engine");
}

pub mod sglang {
    tonic::include_proto!("sglang.grpc.scheduler");
}

pub mod health {
    tonic::include_proto!("grpc.health.v1");
}

/// The gRPC services rankgate fronts and answers, by their full names: the engines' load
/// services and gRPC health. Kept with the generated code they name, below the proxy that
/// serves them and the metrics that label them.
pub const VLLM_SERVICE: &str = "vllm.grpc.engine.VllmEngine";
pub const SGLANG_SERVICE: &str = "sglang.grpc.scheduler.SglangScheduler";
pub const HEALTH_SERVICE: &str = "grpc.health.v1.Health";
