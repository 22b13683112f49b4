//! One engine as the config describes it: its flavor, its place in a DP deployment, its
//! telemetry sources and its key. The types every other module routes by, kept here at the
//! bottom of the crate so that reading a config needs nothing above it.

use std::fmt;
use std::sync::Arc;

use serde::Deserialize;

/// Which engine family serves a rank; decides how a request is pinned and how telemetry is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Flavor {
    Vllm,
    Sglang,
    /// Another gateway (rankgate or smg) in front of its own fleet.
    Gateway,
}

impl Flavor {
    pub fn as_str(self) -> &'static str {
        match self {
            Flavor::Vllm => "vllm",
            Flavor::Sglang => "sglang",
            Flavor::Gateway => "gateway",
        }
    }
}

impl fmt::Display for Flavor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Engine flavors, as a set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Flavors(u8);

impl Flavors {
    pub const VLLM: Flavors = Flavors(1);
    pub const SGLANG: Flavors = Flavors(2);
    pub const BOTH: Flavors = Flavors(3);

    /// The flavors a fleet's engines serve (a gateway: every route).
    pub fn of<'a>(engines: impl IntoIterator<Item = &'a Engine>) -> Flavors {
        Flavors(engines.into_iter().fold(0, |acc, e| {
            acc | match e.flavor {
                Flavor::Vllm => 1,
                Flavor::Sglang => 2,
                Flavor::Gateway => 3,
            }
        }))
    }

    /// No flavor at all (a fleet with no engines).
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Whether the two sets share a flavor.
    pub fn meets(self, other: Flavors) -> bool {
        self.0 & other.0 != 0
    }

    /// Whether an engine of `flavor` serves the route. An upstream gateway fronts engines of
    /// its own and takes whatever it is sent.
    pub fn has(self, flavor: Flavor) -> bool {
        match flavor {
            Flavor::Vllm => self.0 & 1 != 0,
            Flavor::Sglang => self.0 & 2 != 0,
            Flavor::Gateway => true,
        }
    }
}

/// An engine's part in serving generation (`engines[].role`). A model whose engines include
/// prefill and decode servers is served disaggregated: each chat or completion request goes to a
/// prefill rank, then with the KV transfer parameters that rank returned to a decode rank, each
/// rank chosen by its own load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// A whole engine: prefill and decode on the same rank (every engine before roles).
    #[default]
    Both,
    /// A prefill server (vLLM `kv_role: kv_producer`, SGLang `--disaggregation-mode prefill`).
    Prefill,
    /// A decode server (vLLM `kv_role: kv_consumer`, SGLang `--disaggregation-mode decode`).
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// Whether engines of this role take one leg of a disaggregated request, not whole ones.
    pub fn disaggregated(self) -> bool {
        self != Role::Both
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// SGLang's default `--disaggregation-bootstrap-port`, where a prefill server's decode peers
/// fetch the KV of a request.
pub const SGLANG_BOOTSTRAP_PORT: u16 = 8998;

/// How a rank is numbered in the pinning header sent to the engine.
///
/// vLLM versions differ on whether a node owning ranks 4..7 of a hybrid deployment expects the
/// global rank or the node-local index, so it is a per-engine choice (global by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RankNumbering {
    #[default]
    Global,
    Local,
}

/// Which data-parallel deployment an engine's ranks belong to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Deployment {
    /// The engine is a whole DP deployment: its ranks are `0..dp_size`, as it labels them in its
    /// telemetry and accepts them in a pin. The commonest fleet: independent servers, each
    /// started with `--data-parallel-size N`. Two such engines never conflict.
    Own,
    /// One server of a deployment spread over several (vLLM `--data-parallel-start-rank`,
    /// SGLang multi-node DP): its ranks are the deployment's global ranks `start_rank..`. `group`
    /// names the deployment (`dp_group`); `None` is the one unnamed group of config and admin
    /// engines that set `start_rank` alone (configs written before `dp_group` existed).
    Member { group: Option<Arc<str>> },
}

impl Deployment {
    /// Whether two engines' ranks share one numbering, so that they must not overlap. A
    /// discovered engine with `start_rank` and no group numbers its ranks alone, as before.
    pub fn shares_ranks_with(&self, other: &Deployment, both_declared: bool) -> bool {
        match (self, other) {
            (Deployment::Member { group: Some(a) }, Deployment::Member { group: Some(b) }) => {
                a == b
            }
            (Deployment::Member { group: None }, Deployment::Member { group: None }) => {
                both_declared
            }
            _ => false,
        }
    }
}

/// What the config (or admin call, or discovery template) said of an engine's shape; `None`
/// where the engine itself is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Declared {
    pub flavor: Option<Flavor>,
    pub dp_size: Option<u32>,
}

/// What an engine said of itself when asked (`GET /version`, `/get_server_info`, its
/// `/metrics` labels, gRPC `GetServerInfo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reported {
    pub flavor: Flavor,
    /// Its DP ranks, when it told them (a member of a multi-server deployment reports the
    /// deployment's size, not its own share, so it is not asked).
    pub dp_size: Option<u32>,
    /// Where the size was read, for logs and `/workers`.
    pub from: &'static str,
    /// The size is only "at least": read from the ranks its `/metrics` labels, where a rank
    /// with no series yet (starting, or publishing nothing) is missing. Such a count may raise a
    /// configured size, never lower it; a configured rank it lacks stays, unavailable with its
    /// own reason ("no series for rank N"), never routed blind.
    pub at_least: bool,
}

impl Reported {
    /// The ranks an independent engine is routed with, given the configured count.
    pub fn ranks_with(&self, configured: Option<u32>) -> Option<u32> {
        match (self.dp_size, configured) {
            (Some(n), Some(c)) if self.at_least => Some(n.max(c)),
            (n, c) => n.or(c),
        }
    }
}

/// Where an engine's per-rank load comes from, in the engine's order of preference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TelemetrySource {
    /// `GetLoads` on the engine's gRPC service at this `host:port`, over TLS when `tls`.
    Grpc { authority: Arc<str>, tls: bool },
    /// A JSON loads endpoint: SGLang `/v1/loads`, a gateway's `/loads`, or an explicit URL.
    Http { url: Arc<str> },
    /// Prometheus `/metrics` on the engine's base URL.
    Prometheus,
}

impl TelemetrySource {
    /// `scheme://host:port` of a gRPC source.
    pub fn grpc_origin(authority: &str, tls: bool) -> String {
        let scheme = if tls { "https" } else { "http" };
        format!("{scheme}://{authority}")
    }

    pub fn kind(&self) -> SourceKind {
        match self {
            TelemetrySource::Grpc { .. } => SourceKind::Grpc,
            TelemetrySource::Http { .. } => SourceKind::Http,
            TelemetrySource::Prometheus => SourceKind::Prometheus,
        }
    }
}

/// The kind of a telemetry source: what the pollers count reads by, the `source` label of
/// `rankgate_telemetry_polls`, and what `/workers` says produced a rank's numbers. Its name is
/// in one place ([`SourceKind::as_str`]); counters are arrays indexed by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SourceKind {
    Grpc,
    Http,
    Prometheus,
}

impl SourceKind {
    /// Every kind, in the order counters index them.
    pub const ALL: [SourceKind; 3] = [SourceKind::Grpc, SourceKind::Http, SourceKind::Prometheus];

    pub fn as_str(self) -> &'static str {
        match self {
            SourceKind::Grpc => "grpc",
            SourceKind::Http => "http",
            SourceKind::Prometheus => "prometheus",
        }
    }

    /// Its place in [`SourceKind::ALL`], for indexing counters.
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for SourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One engine (one server process hosting one or more DP ranks), as the config describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Engine {
    /// Base URL without trailing slash, e.g. `http://127.0.0.1:8000`.
    pub url: Arc<str>,
    /// `engines[].name` (or the pod's, for one Kubernetes found): what clients are told the
    /// engine is called under `server.expose_worker = "name"`. Never an address: an engine
    /// without one is not named to clients at all.
    pub name: Option<Arc<str>>,
    /// `host:port` authority of `url`, kept for building upstream URIs without re-parsing.
    pub authority: Arc<str>,
    /// The flavor routed by: as configured, else as the engine reported it. Meaningless while
    /// `dp_size` is 0.
    pub flavor: Flavor,
    /// The ranks routed to: an independent engine's own count once it reported it (the engine
    /// wins over the config), else the configured one; 0 while neither is known (no workers).
    pub dp_size: u32,
    pub start_rank: u32,
    pub deployment: Deployment,
    pub declared: Declared,
    /// What the engine last reported of itself (`None` until it has).
    pub reported: Option<Reported>,
    pub rank_header: RankNumbering,
    /// Telemetry sources in order of preference; the first that answers serves.
    pub telemetry: Vec<TelemetrySource>,
    /// Path probed with every telemetry poll (`/health`); `None` means no probe.
    pub health_path: Option<Arc<str>>,
    /// The models it serves, when fixed in the config (else its `/v1/models` says).
    pub models: Option<Vec<String>>,
    /// The bearer key rankgate sends it, on proxied requests and on its own polls.
    pub api_key: Option<ApiKey>,
    /// It serves the OpenAI HTTP API at `url` (an engine started with `--grpc` only does not:
    /// `url` is then its gRPC address, kept as its identity).
    pub http: bool,
    /// `host:port` of its gRPC service (`engines[].grpc_url`), for the gRPC front door.
    pub grpc: Option<Arc<str>>,
    /// Where its KV-cache events come from and whom they are taken from
    /// (`engines[].kv_events`, `kv_events_topic`, `kv_events_from`); `None`: its
    /// `GET /kv_event_sources` says where, and they come from its URL's addresses.
    pub kv_events: Option<Arc<super::kv::KvEvents>>,
    /// `engines[].role`: whole engine, prefill server or decode server.
    pub role: Role,
    /// An SGLang prefill server's `--disaggregation-bootstrap-port` (`engines[].bootstrap_port`,
    /// [`SGLANG_BOOTSTRAP_PORT`] when unset); `None` for every other engine.
    pub bootstrap_port: Option<u16>,
    /// A prefill server's KV lease (`engines[].kv_lease`): how long it keeps a request's
    /// blocks for its decode; `None`: its flavor's default ([`Engine::kv_lease`]).
    pub kv_lease: Option<std::time::Duration>,
    /// `engines[].kv_hosts`: besides its url's host (and the addresses that host resolves
    /// to), the hosts a prefill server's `kv_transfer_params.remote_host` may name, lowercase;
    /// empty for every other engine. Any other host is refused before a decode sees it.
    pub kv_hosts: Vec<Arc<str>>,
    /// `engines[].max_loras`: LoRA adapters one of its ranks runs at once (its `--max-loras`);
    /// `None`: vLLM's default, [`DEFAULT_MAX_LORAS`].
    pub max_loras: Option<u32>,
    /// `engines[].max_adapters`: LoRA adapters the server may hold loaded at once; rankgate
    /// unloads the least recently used declared one (`[[adapters]]`) before it loads another
    /// past it. `None`: no limit of rankgate's (vLLM keeps whatever it is told to load).
    pub max_adapters: Option<u32>,
}

/// vLLM's `--max-loras` default.
pub const DEFAULT_MAX_LORAS: u32 = 1;

/// vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` default (480 s): how long a NixlConnector prefill
/// server keeps the blocks of a request no decode has read.
pub const VLLM_KV_LEASE: std::time::Duration = std::time::Duration::from_secs(480);
/// SGLang's `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` default (300 s): how long a prefill
/// server waits for the decode of a room before it fails the request.
pub const SGLANG_KV_LEASE: std::time::Duration = std::time::Duration::from_secs(300);

impl Engine {
    /// How long this prefill server keeps a request's KV for its decode: its `kv_lease`, else
    /// its flavor's default. A decode leg that failed before its first byte is sent to another
    /// decode rank only within it, since a later one would find the KV gone.
    pub fn kv_lease(&self) -> std::time::Duration {
        self.kv_lease.unwrap_or(match self.flavor {
            Flavor::Sglang => SGLANG_KV_LEASE,
            _ => VLLM_KV_LEASE,
        })
    }

    /// Reached over TLS: its URLs are `https://` (`[engine_tls]` says how). Validation gives
    /// `url` and `grpc_url` one scheme.
    pub fn tls(&self) -> bool {
        self.url.starts_with("https://")
    }

    /// The scheme of its URLs.
    pub fn scheme(&self) -> http::uri::Scheme {
        match self.tls() {
            true => http::uri::Scheme::HTTPS,
            false => http::uri::Scheme::HTTP,
        }
    }

    /// `scheme://authority` of its gRPC service (or of its URL, for a gRPC-only engine).
    pub fn grpc_origin(&self) -> String {
        let authority = self.grpc.as_deref().unwrap_or(&self.authority);
        format!("{}://{authority}", self.scheme())
    }
}

/// An engine's API key: the `Authorization` value, rendered once. Its Debug never shows it.
#[derive(Clone, PartialEq)]
pub struct ApiKey(pub http::HeaderValue);

impl ApiKey {
    /// `Err` when the key cannot be a header value.
    pub fn bearer(key: &str) -> Result<ApiKey, http::header::InvalidHeaderValue> {
        let mut v = http::HeaderValue::from_str(&format!("Bearer {key}"))?;
        v.set_sensitive(true);
        Ok(ApiKey(v))
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(..)")
    }
}

impl Engine {
    /// The ranks this engine manages, as it numbers them: `start_rank .. start_rank + dp_size`
    /// (`0..dp_size` for an engine that is its own deployment).
    pub fn ranks(&self) -> std::ops::Range<u32> {
        self.start_rank..self.start_rank + self.dp_size
    }

    /// The global ranks a group member claims in its deployment (checked for overlap among the
    /// members even before the engine has said its flavor).
    pub fn claimed_ranks(&self) -> std::ops::Range<u32> {
        self.start_rank..self.start_rank + self.declared.dp_size.unwrap_or(1)
    }

    /// Whether the engine itself said `rank` is one of its ranks: it reported its DP size (not a
    /// count of the ranks its `/metrics` happened to label). Such a rank that its report leaves
    /// out is fresh, not unknown.
    pub fn names_rank(&self, rank: u32) -> bool {
        self.reported
            .as_ref()
            .is_some_and(|r| r.dp_size.is_some() && !r.at_least)
            && self.ranks().contains(&rank)
    }

    /// Whether rankgate knows enough to route to it (flavor and size); until then it has no
    /// workers.
    pub fn shaped(&self) -> bool {
        self.dp_size > 0
    }

    /// Where what the config says disagrees with what the engine reported, in words (logged
    /// once when it is found, shown in `/workers` and `rankgate top`).
    pub fn mismatch(&self) -> Option<String> {
        let r = self.reported.as_ref()?;
        let (Some(c), Some(n), Deployment::Own) =
            (self.declared.dp_size, r.dp_size, &self.deployment)
        else {
            return None;
        };
        match (c == n, r.at_least && n < c) {
            (true, _) => None,
            (false, true) => Some(format!(
                "configured dp_size {c}, the engine's {} name only {n}: ranks {n}-{} stay unavailable until their series appear",
                r.from,
                c - 1
            )),
            (false, false) => Some(format!(
                "configured dp_size {c}, the engine reports {n} ranks ({}): its {n} are routed",
                r.from
            )),
        }
    }
}

/// A vLLM engine polled through Prometheus, for unit tests across the crate: `start_rank` set,
/// so a member of the unnamed DP group, as such a config entry is.
#[cfg(test)]
pub fn test_engine(url: &str, dp_size: u32, start_rank: u32) -> Engine {
    Engine {
        url: url.into(),
        name: None,
        authority: url.trim_start_matches("http://").into(),
        flavor: Flavor::Vllm,
        dp_size,
        start_rank,
        // As a config with `start_rank` says it: a member of the unnamed group.
        deployment: Deployment::Member { group: None },
        declared: Declared {
            flavor: Some(Flavor::Vllm),
            dp_size: Some(dp_size),
        },
        reported: None,
        rank_header: RankNumbering::Global,
        telemetry: vec![TelemetrySource::Prometheus],
        health_path: Some("/health".into()),
        models: None,
        api_key: None,
        http: true,
        grpc: None,
        kv_events: None,
        role: Role::Both,
        bootstrap_port: None,
        kv_lease: None,
        kv_hosts: Vec::new(),
        max_loras: None,
        max_adapters: None,
    }
}
