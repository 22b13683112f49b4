//! `--kv-events-config` as vLLM reads it: where each rank's PUB socket lives, its queue and
//! buffer sizes, and the errors of a config that names something else.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use serde_json::Value;

/// Where a rank's PUB socket lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEndpoint {
    /// Bind `host:port + rank` (vLLM's `tcp://*:PORT`: every interface). Port 0 gives each
    /// rank a free port of its own.
    Bind { host: IpAddr, port: u16 },
    /// Connect to `host:port + rank`, where the subscriber binds; reconnects when it goes away.
    Connect { host: String, port: u16 },
}

/// The KV-events part of an engine's configuration, as vLLM's `--kv-events-config` holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    pub endpoint: KvEndpoint,
    /// The first frame of every message; subscribers filter on its prefix.
    pub topic: String,
    /// Messages queued per subscriber before the oldest is dropped (vLLM's `hwm`).
    pub hwm: usize,
    /// Batches each rank keeps for its replay socket (vLLM's `buffer_steps`).
    pub buffer_steps: u64,
    /// Where rank 0's replay socket binds (vLLM's `replay_endpoint`: `tcp://*:PORT` or
    /// `tcp://IP:PORT`, always bound); rank r at the port + r, or a free port each with port 0.
    /// `None`: no replay socket, as vLLM's default.
    pub replay: Option<SocketAddr>,
    pub max_queue_size: u64,
}

/// A `--kv-events-config` the sim cannot use.
#[derive(Debug, thiserror::Error)]
pub enum KvConfigError {
    #[error("--kv-events-config is not a JSON object: {0}")]
    Json(String),
    #[error("--kv-events-config: publisher {0:?} is not supported (only \"zmq\")")]
    Publisher(String),
    #[error("--kv-events-config: endpoint {0:?} is not tcp://HOST:PORT or tcp://*:PORT")]
    Endpoint(String),
    #[error("--kv-events-config: {0}")]
    Field(String),
}

/// vLLM's defaults (`KVEventsConfig`).
const DEFAULT_ENDPOINT: &str = "tcp://*:5557";
const DEFAULT_HWM: usize = 100_000;
const DEFAULT_BUFFER_STEPS: u64 = 10_000;
const DEFAULT_MAX_QUEUE: u64 = 100_000;

impl KvEventsConfig {
    /// Events on 127.0.0.1, each rank binding a free port: what tests and scenarios use.
    pub fn bind_local() -> KvEventsConfig {
        KvEventsConfig {
            endpoint: KvEndpoint::Bind {
                host: IpAddr::V4(Ipv4Addr::LOCALHOST),
                port: 0,
            },
            topic: "kv".into(),
            hwm: DEFAULT_HWM,
            buffer_steps: DEFAULT_BUFFER_STEPS,
            max_queue_size: DEFAULT_MAX_QUEUE,
            replay: None,
        }
    }

    /// As [`KvEventsConfig::bind_local`], with each rank's replay socket on a free port of
    /// 127.0.0.1 keeping `buffer_steps` batches.
    pub fn bind_local_with_replay(buffer_steps: u64) -> KvEventsConfig {
        KvEventsConfig {
            replay: Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0)),
            buffer_steps,
            ..KvEventsConfig::bind_local()
        }
    }

    /// Reads vLLM's `--kv-events-config` JSON. `Ok(None)` when events are off
    /// (`enable_kv_cache_events` false or absent, or publisher `"null"`). `replay_endpoint`,
    /// when set, is bound as vLLM binds it (`tcp://*:PORT` or `tcp://IP:PORT`).
    pub fn from_vllm_json(s: &str) -> Result<Option<KvEventsConfig>, KvConfigError> {
        let v: Value = serde_json::from_str(s).map_err(|e| KvConfigError::Json(e.to_string()))?;
        let o = v
            .as_object()
            .ok_or_else(|| KvConfigError::Json("not an object".into()))?;
        let flag = |k: &str| match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(KvConfigError::Field(format!("{k} must be true or false"))),
        };
        let text = |k: &str| match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(KvConfigError::Field(format!("{k} must be a string"))),
        };
        let count = |k: &str, default: u64| match o.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_u64()
                .ok_or_else(|| KvConfigError::Field(format!("{k} must be a whole number"))),
        };
        let replay = text("replay_endpoint")?;
        if !flag("enable_kv_cache_events")?.unwrap_or(false) {
            return Ok(None);
        }
        match text("publisher")?.as_deref() {
            // vLLM turns the publisher to zmq when events are enabled without one.
            None | Some("zmq") => {}
            Some("null") => return Ok(None),
            Some(other) => return Err(KvConfigError::Publisher(other.into())),
        }
        let endpoint = text("endpoint")?.unwrap_or_else(|| DEFAULT_ENDPOINT.into());
        let hwm = count("hwm", DEFAULT_HWM as u64)?;
        Ok(Some(KvEventsConfig {
            endpoint: parse_endpoint(&endpoint)?,
            topic: text("topic")?.unwrap_or_default(),
            hwm: usize::try_from(hwm).unwrap_or(usize::MAX).max(1),
            buffer_steps: count("buffer_steps", DEFAULT_BUFFER_STEPS)?,
            max_queue_size: count("max_queue_size", DEFAULT_MAX_QUEUE)?,
            replay: replay.as_deref().map(parse_replay).transpose()?,
        }))
    }
}

/// A replay endpoint, which vLLM always binds: `tcp://*:PORT` or `tcp://IP:PORT`.
fn parse_replay(s: &str) -> Result<SocketAddr, KvConfigError> {
    match parse_endpoint(s)? {
        KvEndpoint::Bind { host, port } => Ok(SocketAddr::new(host, port)),
        KvEndpoint::Connect { host, port } => host
            .parse::<IpAddr>()
            .map(|ip| SocketAddr::new(ip, port))
            .map_err(|_| {
                KvConfigError::Field(format!(
                    "replay_endpoint {s:?}: the engine binds it; give * or an IP address"
                ))
            }),
    }
}

/// `tcp://*:PORT` (bind every interface), `tcp://HOST:PORT` (connect), `[v6]` hosts too.
pub fn parse_endpoint(s: &str) -> Result<KvEndpoint, KvConfigError> {
    let bad = || KvConfigError::Endpoint(s.into());
    let rest = s.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match host {
        "" => Err(bad()),
        "*" => Ok(KvEndpoint::Bind {
            host: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            port,
        }),
        h => Ok(KvEndpoint::Connect {
            host: h.into(),
            port,
        }),
    }
}
