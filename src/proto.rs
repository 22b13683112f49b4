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
