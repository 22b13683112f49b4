//! One `[[engines]]` entry (also the admin API's `POST /engines` body) validated into an
//! [`Engine`], and an engine re-shaped by what it reported of itself.

use std::sync::Arc;

use serde::Deserialize;

use super::engine::{
    ApiKey, Declared, Deployment, Engine, Flavor, RankNumbering, Reported, Role,
    SGLANG_BOOTSTRAP_PORT,
};
use super::error::{invalid, ConfigError};
use super::rules::parse_health_path;
use super::sources::{default_sources, engine_addresses, parse_sources, Addresses};

pub const MAX_DP_SIZE: u32 = 4096;

/// One `[[engines]]` entry as written (also the body of the admin API's `POST /engines`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEngine {
    pub(super) url: Option<String>,
    /// What clients are told this engine is called, under `server.expose_worker = "name"`.
    pub(super) name: Option<String>,
    pub(super) grpc_url: Option<String>,
    /// `None`: asked of the engine (`GET /get_server_info` answers for SGLang, `/version` for
    /// vLLM, gRPC `GetServerInfo` for a gRPC-only engine).
    pub(super) flavor: Option<Flavor>,
    /// `None`: an independent engine's own count is read from it; a group member has 1.
    pub(super) dp_size: Option<u32>,
    /// Names the multi-server DP deployment this engine is one member of.
    pub(super) dp_group: Option<String>,
    pub(super) start_rank: Option<u32>,
    pub(super) rank_header: Option<RankNumbering>,
    pub(super) telemetry: Option<Vec<String>>,
    pub(super) health_path: Option<String>,
    pub(super) models: Option<Vec<String>>,
    pub(super) api_key_env: Option<String>,
    /// Its KV-cache events' endpoint, as its `--kv-events-config` writes it.
    pub(super) kv_events: Option<String>,
    pub(super) kv_events_topic: Option<String>,
    /// Addresses its events may also come from, when it connects to an endpoint rankgate binds.
    pub(super) kv_events_from: Option<Vec<String>>,
    /// Its replay socket, as its `--kv-events-config` `replay_endpoint` writes it.
    pub(super) kv_replay: Option<String>,
    /// `prefill` or `decode` for one side of a disaggregated model; unset: a whole engine.
    pub(super) role: Option<Role>,
    /// An SGLang prefill server's `--disaggregation-bootstrap-port`.
    pub(super) bootstrap_port: Option<u16>,
    /// A prefill server's KV lease, where it is not its flavor's default.
    pub(super) kv_lease: Option<super::duration::HumanDuration>,
    /// Hosts a prefill server's `kv_transfer_params.remote_host` may name besides its url's.
    pub(super) kv_hosts: Option<Vec<String>>,
    /// Its `--max-loras`: LoRA adapters one of its ranks runs at once.
    pub(super) max_loras: Option<u32>,
    /// LoRA adapters it may hold loaded at once (`[[adapters]]` loads past it unload one).
    pub(super) max_adapters: Option<u32>,
}

impl RawEngine {
    /// The environment variable the entry names for the engine's key, if any.
    pub fn api_key_env(&self) -> Option<&str> {
        self.api_key_env.as_deref()
    }

    /// Validates one engine entry; `at` names it in errors (`engines[2]`, `POST /engines`).
    pub fn validate(self, at: &str) -> Result<Engine, ConfigError> {
        let addresses = engine_addresses(
            at,
            self.url.as_deref(),
            self.grpc_url.as_deref(),
            self.flavor,
        )?;
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
        let kv_events = super::kv::kv_events(
            at,
            self.kv_events.as_deref(),
            self.kv_events_topic.as_deref(),
            self.kv_events_from.as_deref(),
            self.dp_size,
        )?;
        let kv_events =
            super::kv::with_replay(at, kv_events, self.kv_replay.as_deref(), self.dp_size)?;
        if let Some(name) = &self.name {
            super::edge::check_engine_name(&format!("{at}.name"), name)?;
        }
        let role = self.role.unwrap_or_default();
        let bootstrap_port =
            check_role(at, role, self.flavor, addresses.http, self.bootstrap_port)?;
        let kv_lease = check_lease(at, role, self.kv_lease)?;
        let kv_hosts = check_kv_hosts(at, role, self.kv_hosts)?;
        if let Some(n) = self.max_loras.filter(|n| !(1..=MAX_MAX_LORAS).contains(n)) {
            return Err(invalid(
                format!("{at}.max_loras"),
                format!("{n} must be between 1 and {MAX_MAX_LORAS} (the engine's --max-loras)"),
            ));
        }
        if let Some(n) = self
            .max_adapters
            .filter(|n| !(1..=MAX_MAX_ADAPTERS).contains(n))
        {
            return Err(invalid(
                format!("{at}.max_adapters"),
                format!("{n} must be between 1 and {MAX_MAX_ADAPTERS}"),
            ));
        }
        let not_vllm = matches!(self.flavor, Some(Flavor::Sglang | Flavor::Gateway));
        if self.max_adapters.is_some() && (not_vllm || !addresses.http) {
            return Err(invalid(
                format!("{at}.max_adapters"),
                "rankgate loads adapters on vLLM servers serving OpenAI HTTP only: leave it out here",
            ));
        }
        let api_key = self
            .api_key_env
            .as_deref()
            .map(|var| engine_key(at, var, std::env::var(var).ok()))
            .transpose()?;
        let engine = Engine {
            url: url.into(),
            name: self.name.as_deref().map(Into::into),
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
            kv_events,
            role,
            bootstrap_port,
            kv_lease,
            kv_hosts,
            max_loras: self.max_loras,
            max_adapters: self.max_adapters,
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

/// `engines[].role` and `bootstrap_port` checked together; the bootstrap port an SGLang (or
/// not yet known) prefill server is given.
fn check_role(
    at: &str,
    role: Role,
    flavor: Option<Flavor>,
    http: bool,
    bootstrap_port: Option<u16>,
) -> Result<Option<u16>, ConfigError> {
    let role_key = format!("{at}.role");
    if role.disaggregated() && flavor == Some(Flavor::Gateway) {
        return Err(invalid(
            role_key,
            "a gateway routes whole requests to its own fleet: only a vLLM or SGLang server is a prefill or decode server",
        ));
    }
    if role.disaggregated() && !http {
        return Err(invalid(
            role_key,
            "disaggregated requests are served through the OpenAI HTTP front door: give the engine its `url`",
        ));
    }
    let port_key = format!("{at}.bootstrap_port");
    match (role, flavor, bootstrap_port) {
        (_, _, Some(0)) => Err(invalid(port_key, "0 is no port")),
        (Role::Prefill, Some(Flavor::Vllm), Some(_)) => Err(invalid(
            port_key,
            "a vLLM prefill server needs none (its decode peers pull from the side channel its answer names): remove this key",
        )),
        (Role::Prefill, Some(Flavor::Vllm), None) => Ok(None),
        (Role::Prefill, _, port) => Ok(Some(port.unwrap_or(SGLANG_BOOTSTRAP_PORT))),
        (_, _, Some(_)) => Err(invalid(
            port_key,
            "only an SGLang prefill server has a bootstrap port (set `role = \"prefill\"`, or remove this key)",
        )),
        (_, _, None) => Ok(None),
    }
}

/// `engines[].kv_lease`: only a prefill server holds KV for a decode, for a while.
fn check_lease(
    at: &str,
    role: Role,
    lease: Option<super::duration::HumanDuration>,
) -> Result<Option<std::time::Duration>, ConfigError> {
    let Some(super::duration::HumanDuration(d)) = lease else {
        return Ok(None);
    };
    let key = format!("{at}.kv_lease");
    if role != Role::Prefill {
        return Err(invalid(
            key,
            "only a prefill server keeps KV for its decode (set `role = \"prefill\"`, or remove this key)",
        ));
    }
    if d.is_zero() {
        return Err(invalid(
            key,
            "a lease of 0 leaves no time for the decode: give the prefill server's own (vLLM: VLLM_NIXL_ABORT_REQUEST_TIMEOUT, SGLang: SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)",
        ));
    }
    Ok(Some(d))
}

/// The largest `engines[].max_loras`: far above what an engine runs (each adapter holds a
/// slot of weights on every rank).
pub const MAX_MAX_LORAS: u32 = 256;
/// The largest `engines[].max_adapters`: the adapters `[[adapters]]` may declare at most.
pub const MAX_MAX_ADAPTERS: u32 = 1024;

/// The most hosts `engines[].kv_hosts` may list: a prefill server has an address or a few.
pub const MAX_KV_HOSTS: usize = 64;

/// `engines[].kv_hosts`: the hosts (IP addresses or names, as the prefill server writes them in
/// `kv_transfer_params.remote_host`) its decode may be sent to besides its url's host. Only a
/// prefill server's answers name one. Kept lowercase, IPv6 without brackets.
fn check_kv_hosts(
    at: &str,
    role: Role,
    hosts: Option<Vec<String>>,
) -> Result<Vec<Arc<str>>, ConfigError> {
    let Some(hosts) = hosts else {
        return Ok(Vec::new());
    };
    let key = format!("{at}.kv_hosts");
    if role != Role::Prefill {
        return Err(invalid(
            key,
            "only a prefill server's answers name a KV host (set `role = \"prefill\"`, or remove this key)",
        ));
    }
    if hosts.len() > MAX_KV_HOSTS {
        return Err(invalid(
            key,
            format!("{} hosts: at most {MAX_KV_HOSTS}", hosts.len()),
        ));
    }
    hosts
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let bare = h.trim().trim_start_matches('[').trim_end_matches(']');
            let ok = !bare.is_empty()
                && bare.len() <= 253
                && (bare.parse::<std::net::IpAddr>().is_ok()
                    || bare
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_'));
            match ok {
                true => Ok(Arc::from(bare.to_ascii_lowercase())),
                false => Err(invalid(
                    format!("{key}[{i}]"),
                    "must be an IP address or a host name, without a port or scheme",
                )),
            }
        })
        .collect()
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
