//! The config file: TOML in, a validated [`Config`] out.
//!
//! Unknown keys are errors (`deny_unknown_fields`): a misspelt key that is silently ignored is
//! how a router ends up running with defaults nobody chose. The config sits at the bottom of
//! the crate: it imports nothing of it but one leaf (`crate::model_routes`, the routes table
//! `[[routes]]` is validated into), and every engine type the rest routes by is defined in
//! [`engine`]. This file only declares the parts and re-exports what the crate uses:
//! - `error`: the error type; `duration`: durations as written, and their bounds;
//! - [`engine`]: one engine as configured; `engines`: an `[[engines]]` entry validated;
//!   `sources`: its addresses and telemetry sources;
//! - `server`, `routing`, `polling`, `traces`, `tls`: the `[server]`, `[routing]`,
//!   `[telemetry]`, `[tracing]` and TLS tables; `discovery`: `[[discovery]]`;
//! - `kv`: an engine's KV-event endpoint, and `[[models]]` (tokenizers);
//! - `model_routes`: `[[routes]]`, the model names rewritten to others (aliases, canaries);
//!   `adapters`: `[[adapters]]`, LoRA adapters loaded on demand;
//! - `edge`: what clients are told of the fleet, and whose forwarding headers are believed;
//! - `rules`: rules across engines, and warnings; `roles`: each model's prefill and decode
//!   servers as far as the config tells; `whole`: the file as one [`Config`];
//! - `restart`: which settings a reload cannot apply; `read`: the file read, bounded.

mod adapters;
mod discovery;
mod duration;
mod edge;
pub mod engine;
mod engines;
mod error;
mod flow;
mod kv;
mod model_routes;
mod polling;
mod read;
mod restart;
mod roles;
mod routing;
mod rules;
mod server;
mod sources;
mod tls;
mod token;
mod toml_error;
mod traces;
mod whole;

pub use adapters::{
    adapter_name_problem, adapter_path_problem, MAX_ADAPTER_NAME_BYTES, MAX_ADAPTER_PATH_BYTES,
    MAX_DECLARED_ADAPTERS,
};
pub use discovery::{Discovery, EngineTemplate, Overrides, PortRef, Source as DiscoverySource};
pub use duration::{parse_duration, HumanDuration};
pub use edge::{engine_name_ok, Cidr, ExposeWorker, DEFAULT_EXPOSE_WORKER, MAX_ENGINE_NAME_BYTES};
#[cfg(test)]
pub use engine::test_engine;
pub use engine::{
    ApiKey, Declared, Deployment, Engine, Flavor, Flavors, RankNumbering, Reported, Role,
    SourceKind, TelemetrySource, DEFAULT_MAX_LORAS, SGLANG_BOOTSTRAP_PORT, SGLANG_KV_LEASE,
    VLLM_KV_LEASE,
};
pub use engines::{RawEngine, MAX_DP_SIZE, MAX_MAX_ADAPTERS};
pub use error::ConfigError;
pub use flow::{FlowConfig, Objective, Saturation};
pub use flow::{
    DEFAULT_MAX_WAIT_HEADER, DEFAULT_OBJECTIVE, DEFAULT_OBJECTIVE_HEADER, DEFAULT_TENANT_HEADER,
    MAX_TENANT_BYTES,
};
pub use kv::{KvEndpoint, KvEvents, ModelConfig};
pub use model_routes::{
    DEFAULT_TARGET_WEIGHT, MAX_MODEL_NAME_BYTES, MAX_ROUTES, MAX_TARGETS, MAX_TARGET_WEIGHT,
};
pub use polling::*;
pub use read::{read_regular, MAX_CONFIG_BYTES};
pub use roles::{pairing_errors, role_check, RoleCheck};
pub use routing::*;
pub(crate) use rules::group_text;
pub use rules::{address_warnings, Resolved, DEFAULT_HEALTH_PATH};
pub use server::*;
pub use tls::{EngineTls, ListenerTls};
pub use traces::TracingConfig;
pub use whole::{Config, MAX_WORKERS};
