//! The whole config: the file's tables read as one TOML document, each validated by its own
//! module, then the rules across them. Parsing is pure (`from_str`), so every rule is
//! unit-tested without files; `load` only adds the reading (`read`) and the file name to the
//! error.

use std::collections::HashMap;
use std::net::ToSocketAddrs;
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;

use super::discovery::{Discovery, RawDiscovery};
use super::engine::Engine;
use super::engines::RawEngine;
use super::error::{invalid, ConfigError};
use super::flow::{flow, FlowConfig, RawFlow};
use super::kv::{models, ModelConfig, RawModel};
use super::model_routes::{model_routes, RawRoute};
use super::polling::{telemetry_config, RawTelemetry, TelemetryConfig};
use super::routing::{routing, RawRouting, RoutingConfig};
use super::rules::{address_warnings, check_rank_overlap, Resolved};
use super::server::{server, RawServer, ServerConfig};
use super::tls::EngineTls;
use super::traces::{tracing_config, RawTracing, TracingConfig};

/// Workers (ranks) one rankgate routes at most, over every engine of every source: each costs
/// its share of every snapshot publish and of memory (about a kilobyte with its counters), and
/// a fleet larger than this is better split between rankgates.
pub const MAX_WORKERS: usize = 65_536;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    routing: RawRouting,
    #[serde(default)]
    telemetry: RawTelemetry,
    #[serde(default)]
    engines: Vec<RawEngine>,
    #[serde(default)]
    discovery: Vec<RawDiscovery>,
    #[serde(default)]
    tracing: RawTracing,
    #[serde(default)]
    engine_tls: EngineTls,
    #[serde(default)]
    models: Vec<RawModel>,
    #[serde(default)]
    flow: RawFlow,
    #[serde(default)]
    routes: Vec<RawRoute>,
    #[serde(default)]
    adapters: Vec<super::adapters::RawAdapter>,
}

/// A validated config.
#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub routing: RoutingConfig,
    pub telemetry: TelemetryConfig,
    pub engines: Vec<Engine>,
    pub discovery: Vec<Discovery>,
    pub tracing: TracingConfig,
    /// How `https://` engines are reached.
    pub engine_tls: EngineTls,
    /// `[[models]]`: their tokenizers, for `routing.kv_events`.
    pub models: Vec<ModelConfig>,
    /// `[flow]`: flow control (off unless enabled).
    pub flow: FlowConfig,
    /// `[[routes]]`: model names rewritten to the models engines serve, and `[[adapters]]`:
    /// LoRA adapters loaded on demand (both applied on reload).
    pub routes: Arc<crate::model_routes::Routes>,
    /// Every environment variable an `[[engines]]` or `[[discovery]]` entry names for a key:
    /// the only ones the admin API may name.
    pub key_vars: Vec<String>,
}

/// Where `key` was first seen, or `None` (and `i` noted) if this is its first.
fn first_at(seen: &mut HashMap<Arc<str>, usize>, key: &Arc<str>, i: usize) -> Option<usize> {
    match seen.entry(key.clone()) {
        std::collections::hash_map::Entry::Occupied(at) => Some(*at.get()),
        std::collections::hash_map::Entry::Vacant(at) => {
            at.insert(i);
            None
        }
    }
}

fn too_many(workers: usize) -> ConfigError {
    invalid(
        "engines",
        format!("{workers} workers (the sum of dp_size) is more than one rankgate routes ({MAX_WORKERS}): split the fleet between rankgates"),
    )
}

impl Config {
    /// Reads and validates a config file: a regular file of at most
    /// [`MAX_CONFIG_BYTES`](super::MAX_CONFIG_BYTES) (see `read`). Blocking: the runtime calls it
    /// through `spawn_blocking`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let p = path.display().to_string();
        let text = super::read::read_text(path).map_err(|source| ConfigError::Read {
            path: p.clone(),
            source,
        })?;
        Config::from_str(&text).map_err(|e| e.with_path(&p))
    }

    /// Parses and validates config text. Errors carry an empty path until `load` fills it.
    #[allow(clippy::should_implement_trait)]
    pub fn from_str(text: &str) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: String::new(),
            message: super::toml_error::describe(text, &e),
        })?;
        // What the rules say of a key may quote its value: the file parsed as a rankgate
        // config by then (every table denies unknown keys), so it is the operator's own.
        Config::validate(raw)
    }

    fn validate(raw: RawConfig) -> Result<Config, ConfigError> {
        let server = server(raw.server)?;
        let routing = routing(raw.routing, server.max_body_bytes)?;

        let telemetry = telemetry_config(raw.telemetry)?;
        let tracing = tracing_config(raw.tracing)?;
        let engine_tls = raw.engine_tls.validate()?;
        let models = models(raw.models)?;
        let flow = flow(raw.flow)?;
        let routes = Arc::new(super::adapters::adapters(
            raw.adapters,
            model_routes(raw.routes)?,
        )?);

        let discovery = (raw.discovery.into_iter().enumerate())
            .map(|(i, d)| d.validate(i))
            .collect::<Result<Vec<_>, _>>()?;
        // A fleet may start empty when engines can join at runtime: found by discovery, or
        // added through the admin API.
        if raw.engines.is_empty() && discovery.is_empty() && server.admin_token_env.is_none() {
            return Err(invalid(
                "engines",
                "at least one [[engines]] entry is required (or a [[discovery]] entry, or server.admin_token_env to add engines through the admin API)",
            ));
        }
        let mut key_vars: Vec<String> = (raw.engines.iter())
            .filter_map(|e| e.api_key_env().map(String::from))
            .chain(
                discovery
                    .iter()
                    .filter_map(|d| d.template.api_key_env().map(Into::into)),
            )
            .collect();
        key_vars.sort();
        key_vars.dedup();
        // The engines' count is bounded before any is validated: a file of more entries than
        // workers one rankgate routes is refused in one step (each entry is at least a worker).
        if raw.engines.len() > MAX_WORKERS {
            return Err(too_many(raw.engines.len()));
        }
        let mut engines: Vec<Engine> = Vec::with_capacity(raw.engines.len());
        // Where each URL and gRPC address was first seen: duplicates found in one pass.
        let mut urls: HashMap<Arc<str>, usize> = HashMap::with_capacity(raw.engines.len());
        let mut grpcs: HashMap<Arc<str>, usize> = HashMap::new();
        for (i, e) in raw.engines.into_iter().enumerate() {
            let engine = e.validate(&format!("engines[{i}]"))?;
            if let Some(j) = first_at(&mut urls, &engine.url, i) {
                return Err(invalid(
                    format!("engines[{i}].url"),
                    format!("{:?} is a duplicate of engines[{j}]", engine.url),
                ));
            }
            if let Some(grpc) = &engine.grpc {
                if let Some(j) = first_at(&mut grpcs, grpc, i) {
                    return Err(invalid(
                        format!("engines[{i}].grpc_url"),
                        format!("{:?} is a duplicate of engines[{j}]", engine.grpc_origin()),
                    ));
                }
            }
            engines.push(engine);
        }
        check_rank_overlap(&engines)?;
        // Sizes read from the engines are not known yet; the membership plan counts again.
        let workers: usize = engines.iter().map(|e| e.dp_size as usize).sum();
        if workers > MAX_WORKERS {
            return Err(too_many(workers));
        }
        Ok(Config {
            server,
            routing,
            telemetry,
            engines,
            discovery,
            tracing,
            engine_tls,
            models,
            flow,
            routes,
            key_vars,
        })
    }
}

impl Config {
    /// Legal but likely mistaken settings, for `main` to log at startup. Resolves each engine's
    /// host name (blocking, through the system resolver): call it once, before serving.
    pub fn warnings(&self) -> Vec<String> {
        let resolved: Vec<Resolved> = (self.engines.iter().enumerate())
            .map(|(i, e)| Resolved {
                name: format!("engines[{i}] ({})", e.url),
                addrs: (e.authority.to_socket_addrs())
                    .map(Iterator::collect)
                    .map_err(|err| err.to_string()),
                concerned: true,
            })
            .collect();
        let mut warnings = address_warnings(&resolved);
        warnings.extend(self.roles().warnings);
        // Engines from discovery or the admin API may serve what no fixed list has.
        let closed = self.discovery.is_empty() && self.server.admin_token_env.is_none();
        warnings.extend(super::model_routes::warnings(
            &self.routes,
            &self.engines,
            closed,
        ));
        warnings
    }

    /// Each model's prefill and decode servers as far as the file tells: a side certainly
    /// missing is a warning (also in [`Config::warnings`]), what only the engines can say a note.
    pub fn roles(&self) -> super::roles::RoleCheck {
        let admin = self.server.admin_token_env.is_some();
        super::roles::role_check(&self.engines, &self.discovery, admin)
    }
}

#[cfg(test)]
mod tests;
