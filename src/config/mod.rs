//! The config file: TOML in, a validated [`Config`] out.
//!
//! Parsing is pure (`from_str`) so every rule is unit-tested without files; `load` only adds the
//! file name to the error. Unknown keys are errors (`deny_unknown_fields`): a misspelt key that is
//! silently ignored is how a router ends up running with defaults nobody chose.
//! `front` holds the `[server]` and `[routing]` tables, `rules` the `[telemetry]` table and the
//! rules across engines; this file the rest and the whole.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::worker::{
    ApiKey, Declared, Deployment, Engine, Flavor, RankNumbering, Reported, TelemetrySource,
};

mod discovery;
mod front;
mod rules;
mod tls;
mod traces;
pub use discovery::{Discovery, EngineTemplate, Overrides, PortRef, Source as DiscoverySource};
pub use front::*;
pub(crate) use rules::group_text;
use rules::{check_rank_overlap, parse_health_path, telemetry_config};
pub use tls::{EngineTls, ListenerTls};
pub use traces::TracingConfig;

pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(250);
pub const DEFAULT_STALE_AFTER: Duration = Duration::from_secs(2);
pub const MAX_DP_SIZE: u32 = 4096;
/// Workers (ranks) one rankgate routes at most, over every engine of every source: each costs
/// its share of every snapshot publish and of memory (about a kilobyte with its counters), and
/// a fleet larger than this is better split between rankgates.
pub const MAX_WORKERS: usize = 65_536;
/// Health path of vLLM and SGLang engines; a gateway is probed only when it names one.
pub const DEFAULT_HEALTH_PATH: &str = "/health";
/// Consecutive failed health probes before an engine's ranks are Unavailable: one missed probe
/// on a saturated engine is not a verdict.
pub const DEFAULT_HEALTH_FAILURES: u32 = 2;
/// Polling faster than this only loads the engines; slower than [`MAX_INTERVAL`] routes on
/// numbers too old to mean anything.
pub const MIN_INTERVAL: Duration = Duration::from_millis(10);
pub const MAX_INTERVAL: Duration = Duration::from_secs(60);
/// A poll timeout under this fails against any real engine (a loaded vLLM takes seconds).
pub const MIN_TIMEOUT: Duration = Duration::from_millis(10);
/// Beyond this a rank's numbers are history, not load.
pub const MAX_STALE_AFTER: Duration = Duration::from_secs(3600);

/// A config error: names the file, the key and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: cannot read: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: String, message: String },
    #[error("config file {path}: key `{key}`: {problem}")]
    Invalid {
        path: String,
        key: String,
        problem: String,
    },
}

impl ConfigError {
    /// The error without the file it is in: `key: problem` (for a request's errors, not a
    /// file's).
    pub fn problem(&self) -> String {
        match self {
            ConfigError::Invalid { key, problem, .. } => format!("{key}: {problem}"),
            e => e.to_string(),
        }
    }

    fn with_path(self, p: &str) -> ConfigError {
        match self {
            ConfigError::Read { source, .. } => ConfigError::Read {
                path: p.into(),
                source,
            },
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: p.into(),
                message,
            },
            ConfigError::Invalid { key, problem, .. } => ConfigError::Invalid {
                path: p.into(),
                key,
                problem,
            },
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    #[default]
    LeastKv,
    RoundRobin,
    Random,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::LeastKv => "least_kv",
            Policy::RoundRobin => "round_robin",
            Policy::Random => "random",
        }
    }
}

/// What `least_kv` does when no rank has usable telemetry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum NoTelemetry {
    #[default]
    LeastInFlight,
    Reject,
}

/// A duration written the human way: `250ms`, `2s`, `1.5s`, `1m`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HumanDuration(pub Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = HumanDuration;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a duration with its unit, such as \"250ms\", \"2s\" or \"1m\"")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<HumanDuration, E> {
                parse_duration(s).map(HumanDuration).map_err(E::custom)
            }
            // A bare number is the commonest slip: say what to write instead.
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<HumanDuration, E> {
                Err(E::custom(format!(
                    "{n} has no unit: write it as a string with one, e.g. \"{n}ms\" or \"{n}s\""
                )))
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<HumanDuration, E> {
                self.visit_i64(n.min(i64::MAX as u64) as i64)
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<HumanDuration, E> {
                Err(E::custom(format!(
                    "{n} has no unit: write it as a string with one, e.g. \"{n}s\""
                )))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// Parses `<number><unit>` with unit `ms`, `s` or `m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("duration {s:?} has no unit (use ms, s or m)"))?;
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(format!(
            "duration {s:?} must be a number followed by ms, s or m"
        ));
    }
    let n: f64 = num
        .parse()
        .map_err(|_| format!("duration {s:?}: {num:?} is not a number"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        _ => {
            return Err(format!(
                "duration {s:?}: unknown unit {unit:?} (use ms, s or m)"
            ))
        }
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("duration {s:?}: {e}"))
}

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
    discovery: Vec<discovery::RawDiscovery>,
    #[serde(default)]
    tracing: traces::RawTracing,
    #[serde(default)]
    engine_tls: EngineTls,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawTelemetry {
    interval: Option<HumanDuration>,
    stale_after: Option<HumanDuration>,
    timeout: Option<HumanDuration>,
    health_failures: Option<u32>,
}

/// One `[[engines]]` entry as written (also the body of the admin API's `POST /engines`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEngine {
    url: Option<String>,
    grpc_url: Option<String>,
    /// `None`: asked of the engine (`GET /get_server_info` answers for SGLang, `/version` for
    /// vLLM, gRPC `GetServerInfo` for a gRPC-only engine).
    flavor: Option<Flavor>,
    /// `None`: an independent engine's own count is read from it; a group member has 1.
    dp_size: Option<u32>,
    /// Names the multi-server DP deployment this engine is one member of.
    dp_group: Option<String>,
    start_rank: Option<u32>,
    rank_header: Option<RankNumbering>,
    telemetry: Option<Vec<String>>,
    health_path: Option<String>,
    models: Option<Vec<String>>,
    api_key_env: Option<String>,
}

impl RawEngine {
    /// The environment variable the entry names for the engine's key, if any.
    pub fn api_key_env(&self) -> Option<&str> {
        self.api_key_env.as_deref()
    }

    /// Validates one engine entry; `at` names it in errors (`engines[2]`, `POST /engines`).
    pub fn validate(self, at: &str) -> Result<Engine, ConfigError> {
        let addresses = engine_addresses(at, &self)?;
        let (url, authority) = (addresses.url.clone(), addresses.authority.clone());
        let member = self.dp_group.is_some() || self.start_rank.is_some();
        if self.flavor == Some(Flavor::Gateway) {
            for (k, set) in [
                ("dp_size", self.dp_size.is_some()),
                ("start_rank", self.start_rank.is_some()),
                ("dp_group", self.dp_group.is_some()),
                ("rank_header", self.rank_header.is_some()),
            ] {
                if set {
                    return Err(invalid(
                        format!("{at}.{k}"),
                        "a gateway is one worker without DP ranks: remove this key",
                    ));
                }
            }
        }
        if self.flavor.is_none() && self.telemetry.is_some() {
            return Err(invalid(
                format!("{at}.telemetry"),
                "what a source means depends on the engine's flavor: set `flavor` too (or leave `telemetry` out and both are read from the engine)",
            ));
        }
        // Until the engine says otherwise, a flavor-less engine is read as vLLM; it has no
        // workers until it has answered, so nothing is routed on the guess.
        let flavor = self.flavor.unwrap_or(Flavor::Vllm);
        let telemetry = parse_sources(at, flavor, &url, &addresses, self.telemetry.as_deref())?;
        let health_path = match (addresses.http, self.health_path.as_deref()) {
            (true, path) => parse_health_path(at, flavor, path)?,
            (false, None) => None,
            (false, Some(_)) => {
                return Err(invalid(
                    format!("{at}.health_path"),
                    "probes the engine's url, and this engine has only grpc_url: remove this key (its GetLoads polls show whether it answers)",
                ))
            }
        };
        if let Some(dp_size) = self.dp_size {
            if dp_size == 0 || dp_size > MAX_DP_SIZE {
                return Err(invalid(
                    format!("{at}.dp_size"),
                    format!("{dp_size} must be between 1 and {MAX_DP_SIZE}"),
                ));
            }
        }
        let group = match self.dp_group.as_deref().map(str::trim) {
            Some("") => {
                return Err(invalid(
                    format!("{at}.dp_group"),
                    "must name the deployment (any non-empty name its members share)",
                ))
            }
            g => g.map(Arc::<str>::from),
        };
        let deployment = match member {
            true => Deployment::Member { group },
            false => Deployment::Own,
        };
        let start_rank = self.start_rank.unwrap_or(0);
        if start_rank
            .checked_add(self.dp_size.unwrap_or(1))
            .is_none_or(|end| end > i32::MAX as u32)
        {
            return Err(invalid(
                format!("{at}.start_rank"),
                format!("{start_rank} + dp_size overflows the rank range"),
            ));
        }
        let models = match self.models {
            Some(m) if m.is_empty() || m.iter().any(|id| id.trim().is_empty()) => {
                return Err(invalid(
                    format!("{at}.models"),
                    "must list at least one model, each a non-empty id (leave the key out to read the engine's /v1/models)",
                ))
            }
            m => m,
        };
        let api_key = self
            .api_key_env
            .as_deref()
            .map(|var| engine_key(at, var, std::env::var(var).ok()))
            .transpose()?;
        let engine = Engine {
            url: url.into(),
            authority: authority.into(),
            flavor,
            dp_size: 0,
            start_rank,
            deployment,
            declared: Declared {
                flavor: self.flavor,
                dp_size: self.dp_size,
            },
            reported: None,
            rank_header: self.rank_header.unwrap_or_default(),
            telemetry,
            health_path,
            models,
            api_key,
            http: addresses.http,
            grpc: addresses.grpc.map(Into::into),
        };
        Ok(engine.with_reported(None))
    }
}

impl Engine {
    /// This engine as routed once it reported `reported` (or as configured, with `None`): the
    /// configured flavor, else the reported one, with that flavor's default sources; an
    /// independent engine's own rank count over the configured one (the engine knows how many
    /// ranks it runs), a group member's configured share (1 when unset). Without a known flavor
    /// or an independent engine's size, `dp_size` is 0: no workers yet.
    pub fn with_reported(&self, reported: Option<&Reported>) -> Engine {
        let flavor = self.declared.flavor.or(reported.map(|r| r.flavor));
        let dp_size = match (flavor, &self.deployment) {
            (None, _) => 0,
            (Some(Flavor::Gateway), _) => 1,
            (Some(_), Deployment::Own) => match reported {
                Some(r) => r.ranks_with(self.declared.dp_size).unwrap_or(0),
                None => self.declared.dp_size.unwrap_or(0),
            },
            (Some(_), Deployment::Member { .. }) => self.declared.dp_size.unwrap_or(1),
        };
        let mut e = self.clone();
        e.reported = reported.cloned();
        e.dp_size = dp_size;
        if let Some(f) = flavor.filter(|f| *f != self.flavor) {
            // Only a flavor-less engine changes flavor here, and such an engine has no
            // `telemetry` list of its own (validation requires the flavor with one).
            let addresses = Addresses {
                url: e.url.to_string(),
                authority: e.authority.to_string(),
                http: e.http,
                tls: e.tls(),
                grpc: e.grpc.as_deref().map(Into::into),
            };
            e.telemetry = default_sources(f, &e.url, &addresses);
            e.flavor = f;
        }
        e
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryConfig {
    pub interval: Duration,
    pub stale_after: Duration,
    /// Longest one poll of one engine may take; a slow engine only delays its own ranks.
    pub timeout: Duration,
    /// Consecutive failed health probes before an engine counts as unhealthy (>= 1).
    pub health_failures: u32,
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
    /// Every environment variable an `[[engines]]` or `[[discovery]]` entry names for a key:
    /// the only ones the admin API may name.
    pub key_vars: Vec<String>,
}

pub(crate) fn invalid(key: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        path: String::new(),
        key: key.into(),
        problem: problem.into(),
    }
}

/// Checks an engine base URL: `http://host:port` or `https://host:port`, no userinfo, no `@`,
/// no path, no query. Returns the normalised URL, its authority, and whether it is TLS.
fn parse_engine_url(key: &str, url: &str) -> Result<(String, String, bool), ConfigError> {
    let (scheme, rest, tls) = match (url.strip_prefix("http://"), url.strip_prefix("https://")) {
        (Some(rest), _) => ("http", rest, false),
        (_, Some(rest)) => ("https", rest, true),
        _ => {
            return Err(invalid(
                key,
                format!("{url:?} must start with http:// or https://"),
            ))
        }
    };
    if url.contains('@') {
        return Err(invalid(
            key,
            format!("{url:?} contains '@': give the engine's base URL; ranks come from dp_size and start_rank"),
        ));
    }
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.contains(['/', '?', '#']) {
        return Err(invalid(
            key,
            format!("{url:?} carries a path or query: give the engine's base URL only"),
        ));
    }
    let uri: http::uri::Authority = authority
        .parse()
        .map_err(|_| invalid(key, format!("{url:?} has no valid host:port")))?;
    if uri.host().is_empty() {
        return Err(invalid(key, format!("{url:?} has no host")));
    }
    if uri.port_u16().is_none() {
        return Err(invalid(key, format!("{url:?} has no port")));
    }
    Ok((
        format!("{scheme}://{authority}"),
        authority.to_string(),
        tls,
    ))
}

/// Where an engine is reached: its OpenAI HTTP `url`, its `grpc_url`, or both.
struct Addresses {
    /// The engine's identity: its HTTP base URL, or its gRPC one when it has only that.
    url: String,
    authority: String,
    http: bool,
    /// Its URLs are `https://`.
    tls: bool,
    /// `host:port` of its gRPC service.
    grpc: Option<String>,
}

fn engine_addresses(at: &str, e: &RawEngine) -> Result<Addresses, ConfigError> {
    let http = e
        .url
        .as_deref()
        .map(|u| parse_engine_url(&format!("{at}.url"), u))
        .transpose()?;
    let grpc = e
        .grpc_url
        .as_deref()
        .map(|u| parse_engine_url(&format!("{at}.grpc_url"), u))
        .transpose()?;
    if grpc.is_some() && e.flavor == Some(Flavor::Gateway) {
        return Err(invalid(
            format!("{at}.grpc_url"),
            "a gateway is fronted over HTTP only: remove this key",
        ));
    }
    if let (Some((_, _, h)), Some((_, _, g))) = (&http, &grpc) {
        if h != g {
            return Err(invalid(
                format!("{at}.grpc_url"),
                "url and grpc_url are both http:// or both https://: one engine, one TLS setting",
            ));
        }
    }
    let grpc_authority = grpc.as_ref().map(|(_, a, _)| a.clone());
    let ((url, authority, tls), http) = match (http, grpc) {
        (Some(h), _) => (h, true),
        (None, Some(g)) => (g, false),
        (None, None) => {
            return Err(invalid(
                at,
                "needs `url` (its OpenAI HTTP API), `grpc_url` (its gRPC service, http://host:port), or both",
            ))
        }
    };
    Ok(Addresses {
        url,
        authority,
        http,
        tls,
        grpc: grpc_authority,
    })
}

/// "line N (`the line`): message": the line names the key, which toml's message may not.
fn describe_toml_error(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else {
        return e.message().to_string();
    };
    let start = span.start.min(text.len());
    let line_no = text[..start].matches('\n').count() + 1;
    let line = text.lines().nth(line_no - 1).unwrap_or("").trim();
    format!("line {line_no} (`{line}`): {}", e.message())
}

/// Default telemetry sources: `GetLoads` where the engine serves gRPC (per rank, exact), then
/// per flavor the native per-rank endpoint where the engine has one without extra
/// configuration, Prometheus as the fallback.
fn default_sources(flavor: Flavor, url: &str, a: &Addresses) -> Vec<TelemetrySource> {
    let grpc = a.grpc.iter().map(|authority| TelemetrySource::Grpc {
        authority: authority.as_str().into(),
        tls: a.tls,
    });
    if !a.http {
        return grpc.collect();
    }
    grpc.chain(http_sources(flavor, url)).collect()
}

fn http_sources(flavor: Flavor, url: &str) -> Vec<TelemetrySource> {
    match flavor {
        Flavor::Vllm => vec![TelemetrySource::Prometheus],
        Flavor::Sglang => vec![
            TelemetrySource::Http {
                url: format!("{url}/v1/loads?include=core").into(),
            },
            TelemetrySource::Prometheus,
        ],
        Flavor::Gateway => vec![TelemetrySource::Http {
            url: format!("{url}/loads").into(),
        }],
    }
}

/// Parses `telemetry = [...]`: `"grpc://host:port"` (`"grpcs://"` over TLS), `"http"` (the
/// flavor's loads path on the engine URL), `"http://host:port/path"` or `"https://..."` (an
/// explicit loads URL), `"prometheus"`.
fn parse_sources(
    at: &str,
    flavor: Flavor,
    url: &str,
    addresses: &Addresses,
    list: Option<&[String]>,
) -> Result<Vec<TelemetrySource>, ConfigError> {
    let key = format!("{at}.telemetry");
    let Some(list) = list else {
        return Ok(default_sources(flavor, url, addresses));
    };
    if !addresses.http {
        if let Some(s) = list.iter().find(|s| *s == "http" || *s == "prometheus") {
            return Err(invalid(
                key,
                format!("{s:?} is read from the engine's url, and this engine has only grpc_url: use \"grpc://host:port\" or an explicit \"http://host:port/path\""),
            ));
        }
    }
    if list.is_empty() {
        return Err(invalid(key, "needs at least one source"));
    }
    let mut out = Vec::with_capacity(list.len());
    for s in list {
        let grpc = (s.strip_prefix("grpc://").map(|r| (r, false)))
            .or_else(|| s.strip_prefix("grpcs://").map(|r| (r, true)));
        let src = if let Some((rest, tls)) = grpc {
            if flavor == Flavor::Gateway {
                return Err(invalid(
                    key,
                    "a gateway is read through its HTTP /loads rollup, not gRPC",
                ));
            }
            let a: http::uri::Authority = rest
                .trim_end_matches('/')
                .parse()
                .map_err(|_| invalid(&key, format!("{s:?} has no valid host:port")))?;
            if a.port_u16().is_none() || a.as_str().contains('@') {
                return Err(invalid(&key, format!("{s:?} needs host:port and no '@'")));
            }
            TelemetrySource::Grpc {
                authority: a.as_str().into(),
                tls,
            }
        } else if s == "http" {
            match flavor {
                Flavor::Vllm => {
                    return Err(invalid(
                        key,
                        "vLLM serves no per-rank HTTP loads endpoint (its /load is one in-flight count); use grpc://... or prometheus",
                    ))
                }
                _ => match http_sources(flavor, url).into_iter().next() {
                    Some(src @ TelemetrySource::Http { .. }) => src,
                    _ => return Err(invalid(key, "no default HTTP loads endpoint for this flavor")),
                },
            }
        } else if s.starts_with("http://") || s.starts_with("https://") {
            if s.contains('@') {
                return Err(invalid(key, format!("{s:?} contains '@'")));
            }
            let _: http::Uri = s
                .parse()
                .map_err(|_| invalid(&key, format!("{s:?} is not a valid URL")))?;
            TelemetrySource::Http {
                url: s.as_str().into(),
            }
        } else if s == "prometheus" {
            if flavor == Flavor::Gateway {
                return Err(invalid(
                    key,
                    "a gateway's /metrics carries no per-rank KV; use its /loads (\"http\")",
                ));
            }
            TelemetrySource::Prometheus
        } else {
            return Err(invalid(
                key,
                format!("unknown source {s:?}: use \"grpc://host:port\", \"http\", \"http://host:port/path\" or \"prometheus\""),
            ));
        };
        if out.contains(&src) {
            return Err(invalid(key, format!("{s:?} is listed twice")));
        }
        out.push(src);
    }
    Ok(out)
}

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
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
            message: describe_toml_error(text, &e),
        })?;
        Config::validate(raw)
    }

    fn validate(raw: RawConfig) -> Result<Config, ConfigError> {
        let server = front::server(raw.server)?;
        let routing = front::routing(raw.routing, server.max_body_bytes)?;

        let telemetry = telemetry_config(raw.telemetry)?;
        let tracing = traces::tracing_config(raw.tracing)?;
        let engine_tls = raw.engine_tls.validate()?;

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
            .filter_map(|e| e.api_key_env.clone())
            .chain(
                discovery
                    .iter()
                    .filter_map(|d| d.template.api_key_env().map(Into::into)),
            )
            .collect();
        key_vars.sort();
        key_vars.dedup();
        let mut engines: Vec<Engine> = Vec::with_capacity(raw.engines.len());
        for (i, e) in raw.engines.into_iter().enumerate() {
            let engine = e.validate(&format!("engines[{i}]"))?;
            if let Some(j) = engines.iter().position(|o| *o.url == *engine.url) {
                return Err(invalid(
                    format!("engines[{i}].url"),
                    format!("{:?} is a duplicate of engines[{j}]", engine.url),
                ));
            }
            if let Some(j) = engines
                .iter()
                .position(|o| o.grpc.is_some() && o.grpc == engine.grpc)
            {
                return Err(invalid(
                    format!("engines[{i}].grpc_url"),
                    format!("{:?} is a duplicate of engines[{j}]", engine.grpc_origin()),
                ));
            }
            engines.push(engine);
        }
        check_rank_overlap(&engines)?;
        // Sizes read from the engines are not known yet; the membership plan counts again.
        let workers: usize = engines.iter().map(|e| e.dp_size as usize).sum();
        if workers > MAX_WORKERS {
            return Err(invalid(
                "engines",
                format!("{workers} workers (the sum of dp_size) is more than one rankgate routes ({MAX_WORKERS}): split the fleet between rankgates"),
            ));
        }
        Ok(Config {
            server,
            routing,
            telemetry,
            engines,
            discovery,
            tracing,
            engine_tls,
            key_vars,
        })
    }
}

/// The key in the environment variable `var` that `engines[i].api_key_env` names. The error
/// names the variable, never a value.
fn engine_key(at: &str, var: &str, value: Option<String>) -> Result<ApiKey, ConfigError> {
    let key = format!("{at}.api_key_env");
    match value.as_deref().map(str::trim) {
        None | Some("") => Err(invalid(
            key,
            format!("environment variable {var:?} is not set or empty"),
        )),
        Some(v) => ApiKey::bearer(v).map_err(|_| {
            invalid(
                key,
                format!("environment variable {var:?} holds characters a header cannot carry"),
            )
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_duration_without_its_unit_says_how_to_write_it() {
        let e =
            Config::from_str("[telemetry]\ninterval = 250\n[[engines]]\nurl = \"http://a:1\"\n")
                .unwrap_err()
                .to_string();
        assert!(
            e.contains("250 has no unit") && e.contains("\"250ms\""),
            "{e}"
        );
        let e =
            Config::from_str("[telemetry]\ninterval = true\n[[engines]]\nurl = \"http://a:1\"\n")
                .unwrap_err()
                .to_string();
        assert!(e.contains("such as \"250ms\""), "{e}");
    }

    #[test]
    fn what_the_engine_reports_shapes_it() {
        let c = Config::from_str("[[engines]]\nurl = \"http://a:1\"\n").unwrap();
        let e = &c.engines[0];
        let sglang = Reported {
            flavor: Flavor::Sglang,
            dp_size: Some(4),
            from: "test",
            at_least: false,
        };
        let shaped = e.with_reported(Some(&sglang));
        assert_eq!((shaped.flavor, shaped.dp_size), (Flavor::Sglang, 4));
        // The flavor's own sources: SGLang's /v1/loads first.
        assert!(
            matches!(&shaped.telemetry[0], TelemetrySource::Http { url } if url.ends_with("/v1/loads?include=core"))
        );
        assert_eq!(shaped.mismatch(), None);
        // A configured size loses to the engine's, and says so.
        let c = Config::from_str(
            "[[engines]]\nurl = \"http://a:1\"\nflavor = \"sglang\"\ndp_size = 2\n",
        )
        .unwrap();
        let shaped = c.engines[0].with_reported(Some(&sglang));
        assert_eq!(shaped.dp_size, 4);
        assert!(shaped.mismatch().unwrap().contains("configured dp_size 2"));
        // Ranks counted from /metrics labels are "at least": a configured rank without a series
        // yet stays (unavailable for want of telemetry), noted but not dropped.
        let labels = Reported {
            flavor: Flavor::Sglang,
            dp_size: Some(1),
            from: "test",
            at_least: true,
        };
        let shaped = c.engines[0].with_reported(Some(&labels));
        assert_eq!(shaped.dp_size, 2);
        assert!(shaped.mismatch().unwrap().contains("name only 1"));
        let more = Reported {
            dp_size: Some(3),
            ..labels
        };
        assert_eq!(c.engines[0].with_reported(Some(&more)).dp_size, 3);
        // A group member keeps its configured share whatever the deployment's size.
        let c = Config::from_str(
            "[[engines]]\nurl = \"http://a:1\"\nflavor = \"sglang\"\ndp_size = 2\nstart_rank = 2\n",
        )
        .unwrap();
        assert_eq!(c.engines[0].with_reported(Some(&sglang)).ranks(), 2..4);
    }

    const MIN: &str =
        "[[engines]]\nurl = \"http://127.0.0.1:18001\"\nflavor = \"vllm\"\ndp_size = 2\n";

    fn err(text: &str) -> String {
        Config::from_str(text).unwrap_err().to_string()
    }

    #[test]
    fn a_fleet_beyond_the_worker_cap_is_refused() {
        let text: String = (0..17)
            .map(|i| format!("[[engines]]\nurl = \"http://h{i}:1\"\nflavor = \"vllm\"\ndp_size = 4096\nstart_rank = {}\n", i * 4096))
            .collect();
        let e = err(&text);
        assert!(
            e.contains("engines") && e.contains("69632 workers") && e.contains("65536"),
            "{e}"
        );
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = Config::from_str(MIN).unwrap();
        assert_eq!(c.telemetry.interval, DEFAULT_INTERVAL);
        assert_eq!(c.telemetry.stale_after, DEFAULT_STALE_AFTER);
        assert_eq!(c.routing.policy, Policy::LeastKv);
        assert_eq!(c.engines[0].ranks(), 0..2);
        assert_eq!(&*c.engines[0].authority, "127.0.0.1:18001");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("5h").is_err());
        assert!(parse_duration("ms").is_err());
    }

    #[test]
    fn unknown_key_is_named() {
        let e = err(&format!("[server]\nlisen = \"127.0.0.1:1\"\n{MIN}"));
        assert!(e.contains("lisen"), "{e}");
    }

    #[test]
    fn engine_url_rules() {
        let at = err("[[engines]]\nurl = \"http://h:1@3\"\nflavor = \"vllm\"\n");
        assert!(at.contains("engines[0].url") && at.contains('@'), "{at}");
        let path = err("[[engines]]\nurl = \"http://h:1/v1\"\nflavor = \"vllm\"\n");
        assert!(path.contains("path"), "{path}");
        let dup = err(&format!("{MIN}{MIN}"));
        assert!(
            dup.contains("engines[1].url") && dup.contains("duplicate"),
            "{dup}"
        );
        let port = err("[[engines]]\nurl = \"http://h\"\nflavor = \"vllm\"\n");
        assert!(port.contains("port"), "{port}");
    }

    #[test]
    fn resilience_keys_have_defaults_and_bounds() {
        let c = Config::from_str(MIN).unwrap();
        assert_eq!(c.server.response_timeout, DEFAULT_RESPONSE_TIMEOUT);
        assert_eq!(c.routing.max_attempts, 3);
        assert_eq!(c.server.max_in_flight, None);
        let e = err(&format!("[server]\nresponse_timeout = \"1ms\"\n{MIN}"));
        assert!(
            e.contains("server.response_timeout") && e.contains("range"),
            "{e}"
        );
        let e = err(&format!("[routing]\nmax_attempts = 0\n{MIN}"));
        assert!(e.contains("routing.max_attempts"), "{e}");
        let e = err(&format!("[routing]\nretry_budget = 1.5\n{MIN}"));
        assert!(e.contains("routing.retry_budget"), "{e}");
        let e = err(&format!("[server]\nmax_in_flight = 0\n{MIN}"));
        assert!(e.contains("server.max_in_flight"), "{e}");
        let e = err(&format!("[server]\nmax_header_bytes = 100\n{MIN}"));
        assert!(e.contains("server.max_header_bytes"), "{e}");
        let e = err(&format!("[server]\nmax_header_bytes = 4294967396\n{MIN}"));
        assert!(e.contains("server.max_header_bytes"), "{e}");
        let e = err(&format!("[routing]\neject_for = \"10m\"\n{MIN}"));
        assert!(e.contains("routing.eject_for"), "{e}");
    }

    #[test]
    fn front_door_access_keys() {
        let c = Config::from_str(&format!(
            "[server]\napi_keys_env = \"RG_KEYS\"\napi_keys_file = \"/etc/rg/keys\"\n\
             cors_allow_origins = [\"https://app.example.com\", \"http://localhost:3000\", \"*\"]\n{MIN}"
        ))
        .unwrap();
        assert_eq!(c.server.api_keys_env.as_deref(), Some("RG_KEYS"));
        assert_eq!(c.server.cors_allow_origins.len(), 3);
        let e = err(&format!("[server]\napi_keys_env = \"\"\n{MIN}"));
        assert!(e.contains("server.api_keys_env"), "{e}");
        let e = err(&format!("[server]\napi_keys_env = \"A=B\"\n{MIN}"));
        assert!(e.contains("server.api_keys_env"), "{e}");
        let e = err(&format!("[server]\napi_keys_file = \"\"\n{MIN}"));
        assert!(e.contains("server.api_keys_file"), "{e}");
        for bad in [
            "app.example.com",
            "https://app.example.com/",
            "https://",
            "https://a b",
        ] {
            let e = err(&format!(
                "[server]\ncors_allow_origins = [\"*\", {bad:?}]\n{MIN}"
            ));
            assert!(e.contains("server.cors_allow_origins[1]"), "{bad}: {e}");
        }
    }

    #[test]
    fn stale_after_must_exceed_interval() {
        let e = err(&format!(
            "[telemetry]\ninterval = \"1s\"\nstale_after = \"500ms\"\n{MIN}"
        ));
        assert!(e.contains("telemetry.stale_after"), "{e}");
    }

    #[test]
    fn https_engines_and_tls_sources() {
        let c = Config::from_str(
            "[[engines]]\nurl = \"https://h:1/\"\ngrpc_url = \"https://h:2\"\nflavor = \"vllm\"\n[[engines]]\nurl = \"http://g:1\"\nflavor = \"sglang\"\ntelemetry = [\"grpcs://g:2\", \"https://g:3/loads\"]\n",
        )
        .unwrap();
        let (tls, clear) = (&c.engines[0], &c.engines[1]);
        assert!(tls.tls() && !clear.tls());
        assert_eq!(&*tls.url, "https://h:1");
        assert_eq!(tls.grpc_origin(), "https://h:2");
        assert_eq!(
            tls.telemetry[0],
            TelemetrySource::Grpc {
                authority: "h:2".into(),
                tls: true
            },
            "GetLoads over TLS, as the engine's gRPC URL says"
        );
        assert_eq!(
            clear.telemetry,
            [
                TelemetrySource::Grpc {
                    authority: "g:2".into(),
                    tls: true
                },
                TelemetrySource::Http {
                    url: "https://g:3/loads".into()
                }
            ]
        );
        let e = err(
            "[[engines]]\nurl = \"https://h:1\"\ngrpc_url = \"http://h:2\"\nflavor = \"vllm\"\n",
        );
        assert!(
            e.contains("engines[0].grpc_url") && e.contains("one TLS setting"),
            "{e}"
        );
        let e = err("[[engines]]\nurl = \"ftp://h:1\"\nflavor = \"vllm\"\n");
        assert!(e.contains("http:// or https://"), "{e}");
        let e = err("[engine_tls]\ncert_file = \"c.pem\"\n[[engines]]\nurl = \"http://h:1\"\n");
        assert!(e.contains("engine_tls") && e.contains("key_file"), "{e}");
        let e = err("[server.tls]\ncert_file = \"c.pem\"\nkey_file = \"k.pem\"\nkey = 1\n[[engines]]\nurl = \"http://h:1\"\n");
        assert!(e.contains("unknown field `key`"), "{e}");
    }

    #[test]
    fn telemetry_sources() {
        let sg =
            Config::from_str("[[engines]]\nurl = \"http://h:1\"\nflavor = \"sglang\"\n").unwrap();
        assert_eq!(
            sg.engines[0].telemetry,
            [
                TelemetrySource::Http {
                    url: "http://h:1/v1/loads?include=core".into()
                },
                TelemetrySource::Prometheus
            ]
        );
        let v = Config::from_str(
            "[[engines]]\nurl = \"http://h:1\"\nflavor = \"vllm\"\ntelemetry = [\"grpc://h:2\", \"prometheus\"]\n",
        )
        .unwrap();
        assert_eq!(
            v.engines[0].telemetry[0],
            TelemetrySource::Grpc {
                authority: "h:2".into(),
                tls: false,
            }
        );
        let e =
            err("[[engines]]\nurl = \"http://h:1\"\nflavor = \"vllm\"\ntelemetry = [\"http\"]\n");
        assert!(
            e.contains("engines[0].telemetry") && e.contains("vLLM"),
            "{e}"
        );
        let e = err("[[engines]]\nurl = \"http://h:1\"\nflavor = \"vllm\"\ntelemetry = [\"carrier-pigeon\"]\n");
        assert!(e.contains("unknown source"), "{e}");
        let e = err("[[engines]]\nurl = \"http://h:1\"\nflavor = \"gateway\"\ndp_size = 2\n");
        assert!(e.contains("engines[0].dp_size"), "{e}");
        let g =
            Config::from_str("[[engines]]\nurl = \"http://h:1\"\nflavor = \"gateway\"\n").unwrap();
        assert_eq!(
            g.engines[0].telemetry,
            [TelemetrySource::Http {
                url: "http://h:1/loads".into()
            }]
        );
    }

    #[test]
    fn engines_by_http_grpc_or_both() {
        let grpc = |extra: &str| {
            format!("[[engines]]\ngrpc_url = \"http://h:9\"\nflavor = \"vllm\"\n{extra}")
        };
        let only = Config::from_str(&grpc("")).unwrap();
        let e = &only.engines[0];
        assert!(!e.http && e.grpc.as_deref() == Some("h:9"));
        assert_eq!(&*e.url, "http://h:9", "the gRPC address is its identity");
        assert_eq!(
            e.telemetry,
            [TelemetrySource::Grpc {
                authority: "h:9".into(),
                tls: false,
            }],
            "polled by GetLoads"
        );
        assert_eq!(e.health_path, None, "no HTTP to probe");
        for bad in ["telemetry = [\"prometheus\"]", "telemetry = [\"http\"]"] {
            let e = err(&grpc(bad));
            assert!(
                e.contains("engines[0].telemetry") && e.contains("grpc_url"),
                "{e}"
            );
        }
        let e = err(&grpc("health_path = \"/health\""));
        assert!(e.contains("engines[0].health_path"), "{e}");
        let both = Config::from_str(&grpc("url = \"http://h:1\"")).unwrap();
        let e = &both.engines[0];
        assert!(e.http && &*e.url == "http://h:1");
        assert_eq!(
            e.telemetry,
            [
                TelemetrySource::Grpc {
                    authority: "h:9".into(),
                    tls: false,
                },
                TelemetrySource::Prometheus
            ],
            "GetLoads first, Prometheus behind it"
        );
        let e = err("[[engines]]\nflavor = \"vllm\"\n");
        assert!(e.contains("engines[0]") && e.contains("grpc_url"), "{e}");
        let e = err("[[engines]]\ngrpc_url = \"grpc://h:9\"\nflavor = \"vllm\"\n");
        assert!(
            e.contains("engines[0].grpc_url") && e.contains("http://"),
            "{e}"
        );
        let e = err("[[engines]]\ngrpc_url = \"http://h:9\"\nflavor = \"gateway\"\n");
        assert!(e.contains("engines[0].grpc_url"), "{e}");
        let e = err(&format!(
            "{}{}",
            grpc(""),
            grpc("start_rank = 1").replace("h:9\"", "h:9/\"")
        ));
        assert!(e.contains("engines[1]") && e.contains("duplicate"), "{e}");
        let e = err(&format!(
            "[server]\ngrpc_listen = \"127.0.0.1:8080\"\n{}",
            grpc("")
        ));
        assert!(e.contains("server.grpc_listen"), "{e}");
        let e = err(&format!(
            "[server]\ngrpc_listen = \"nowhere\"\n{}",
            grpc("")
        ));
        assert!(e.contains("server.grpc_listen"), "{e}");
    }

    #[test]
    fn bad_flavor_and_policy_are_named() {
        let e = err("[[engines]]\nurl = \"http://h:1\"\nflavor = \"tgi\"\n");
        assert!(e.contains("tgi"), "{e}");
        let e = err(&format!("[routing]\npolicy = \"fastest\"\n{MIN}"));
        assert!(e.contains("fastest"), "{e}");
    }
}
