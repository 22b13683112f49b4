//! Virtual workers: the identity `<base-url>@<global rank>` and the expansion of engines into them.
//!
//! An engine serving `dp_size` data-parallel ranks becomes `dp_size` virtual workers. The `@rank`
//! suffix is identity only: every outbound request goes to the engine's base URL, so the id is a
//! typed pair and never a string that someone parses back into a URL (a URL parser reads
//! `http://h:p@3` as user `h:p` at host `3`). An upstream gateway is one worker with no rank: its
//! load report is a fleet rollup, not one engine's DP ranks.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use http::HeaderValue;
use serde::Deserialize;

use crate::live::Live;
use crate::metrics::counts::{PollCounters, WorkerCounters};
use crate::upstream::{ConnLimits, EngineConn};

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

    pub fn name(&self) -> &'static str {
        match self {
            TelemetrySource::Grpc { .. } => "grpc",
            TelemetrySource::Http { .. } => "http",
            TelemetrySource::Prometheus => "prometheus",
        }
    }
}

/// One engine (one server process hosting one or more DP ranks), as the config describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Engine {
    /// Base URL without trailing slash, e.g. `http://127.0.0.1:8000`.
    pub url: Arc<str>,
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
}

impl Engine {
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

/// Identity of a virtual worker: one DP rank of one engine, displayed `engine@rank`, or a whole
/// upstream gateway, displayed as its URL.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RankId {
    pub engine: Arc<str>,
    /// Global DP rank; `None` for a gateway.
    pub rank: Option<u32>,
}

impl fmt::Display for RankId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.rank {
            Some(r) => write!(f, "{}@{}", self.engine, r),
            None => f.write_str(&self.engine),
        }
    }
}

impl RankId {
    /// Parses `base@rank`, splitting on the LAST `@` and only when all that follows is digits;
    /// anything else is not a virtual worker id.
    pub fn parse(s: &str) -> Option<RankId> {
        let (base, rank) = s.rsplit_once('@')?;
        if base.is_empty() || rank.is_empty() || !rank.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        Some(RankId {
            engine: base.into(),
            rank: Some(rank.parse().ok()?),
        })
    }
}

/// A stable name for one engine entry: never reused, so a retry's "not this engine again" or a
/// report from a poller means the same engine whatever joined or left the fleet since.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineId(u64);

/// A stable name for one virtual worker (see [`EngineId`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(u64);

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Relaxed)
}

/// Where an engine's membership comes from; each source manages only its own engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// `[[engines]]` in the config file (replaced as a whole on reload).
    Config,
    /// Added through the admin API.
    Admin,
    /// Found by `[[discovery]]` entry `i`.
    Discovery(usize),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Config => f.write_str("config"),
            Origin::Admin => f.write_str("admin"),
            Origin::Discovery(i) => write!(f, "discovery[{i}]"),
        }
    }
}

/// One virtual worker for as long as anything refers to it: its identity, what is sent to pin
/// it, and its counters. A worker whose engine left the fleet lives on in the requests still on
/// it, which keep counting against it and finish normally.
#[derive(Debug)]
pub struct Member {
    pub key: WorkerId,
    pub id: RankId,
    /// The id pre-rendered once, since every proxied response carries it in a header.
    pub id_text: Arc<str>,
    /// The same as an `x-rankgate-worker` header value.
    pub header: HeaderValue,
    /// Value of the pinning header / body field, per the engine's numbering; `None` for a
    /// gateway, which routes by itself.
    pub pin_rank: Option<u32>,
    pub pin_header: Option<HeaderValue>,
    pub live: Live,
    pub counters: WorkerCounters,
    /// Polls in which the rank's entry was present but invalid or duplicated.
    pub invalid_entries: AtomicU64,
    /// Prompt prefixes recently sent here (`routing.prefix_affinity`).
    pub prefixes: crate::prefix::RankPrefixes,
}

/// One engine in the fleet: its config, where it came from, its connections and its workers.
#[derive(Debug)]
pub struct EngineEntry {
    pub key: EngineId,
    pub cfg: Engine,
    pub origin: Origin,
    pub conn: EngineConn,
    /// Its virtual workers, one per global rank (a gateway: one).
    pub members: Box<[Arc<Member>]>,
    /// Its telemetry polls' counters, here so that they leave `/metrics` with the engine;
    /// shared with the entry it replaces when its keys or source change, like its workers.
    pub polls: Arc<PollCounters>,
    /// Why its flavor or size is not known yet (the last failed attempt to ask it), written by
    /// its poller; `None` once known. Read by `/workers`, never on the request path.
    pub unshaped: arc_swap::ArcSwapOption<String>,
}

impl std::ops::Deref for EngineEntry {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        &self.cfg
    }
}

impl EngineEntry {
    /// Expands `cfg` into one worker per global rank (a gateway into one worker). The workers
    /// of `prev` (the same engine's entry before its keys or source changed) that are the same
    /// rank pinned the same way carry on, counters, ejections and telemetry included.
    pub fn new(
        cfg: Engine,
        origin: Origin,
        limits: ConnLimits,
        prev: Option<&EngineEntry>,
    ) -> Arc<EngineEntry> {
        let gateway = cfg.flavor == Flavor::Gateway;
        let members = cfg
            .ranks()
            .map(|rank| {
                let id = RankId {
                    engine: cfg.url.clone(),
                    rank: (!gateway).then_some(rank),
                };
                let pin_rank = (!gateway).then_some(match cfg.rank_header {
                    RankNumbering::Global => rank,
                    RankNumbering::Local => rank - cfg.start_rank,
                });
                let same = prev
                    .into_iter()
                    .flat_map(|p| p.members.iter())
                    .find(|m| m.id == id && m.pin_rank == pin_rank);
                if let Some(m) = same {
                    return m.clone();
                }
                let id_text: Arc<str> = id.to_string().into();
                Arc::new(Member {
                    key: WorkerId(next_id()),
                    // Engine URLs are validated header-safe; a failure would be a validation bug.
                    header: HeaderValue::from_str(&id_text)
                        .unwrap_or(HeaderValue::from_static("invalid")),
                    id_text,
                    id,
                    pin_rank,
                    pin_header: pin_rank.map(HeaderValue::from),
                    live: Live::default(),
                    counters: WorkerCounters::default(),
                    invalid_entries: AtomicU64::new(0),
                    prefixes: Default::default(),
                })
            })
            .collect();
        Arc::new(EngineEntry {
            key: EngineId(next_id()),
            conn: EngineConn::new(&cfg.authority, cfg.tls(), cfg.grpc.as_deref(), limits),
            cfg,
            origin,
            members,
            polls: prev.map_or_else(Arc::default, |p| p.polls.clone()),
            unshaped: Default::default(),
        })
    }
}

/// A worker's place in one version of the fleet: the worker and the index of its engine in
/// that version's [`Fleet::engines`].
#[derive(Debug, Clone)]
pub struct Seat {
    pub member: Arc<Member>,
    pub engine: usize,
}

impl std::ops::Deref for Seat {
    type Target = Member;
    fn deref(&self) -> &Member {
        &self.member
    }
}

/// One version of the fleet: its engines and their workers, in order (config file first, then
/// admin additions, then discovered engines). Part of the snapshot, so indices into it are only
/// meaningful together with the snapshot's other per-worker and per-engine vectors.
#[derive(Debug, Clone, Default)]
pub struct Fleet {
    pub engines: Vec<Arc<EngineEntry>>,
    pub workers: Vec<Seat>,
    /// What the HTTP front door needs to know of the engines that serve it.
    pub http: HttpShape,
}

/// The flavors among the engines serving OpenAI HTTP, for routes only some flavors serve.
#[derive(Debug, Clone, Copy, Default)]
pub struct HttpShape {
    pub flavors: Flavors,
    /// More than one flavor: some routes then exclude some engines.
    pub mixed_flavors: bool,
    /// Some engine takes the rank in the body (SGLang), so bodies are read whole.
    pub pins_in_body: bool,
}

impl Fleet {
    pub fn new(engines: Vec<Arc<EngineEntry>>) -> Fleet {
        let workers = (engines.iter().enumerate())
            .flat_map(|(e, entry)| {
                (entry.members.iter()).map(move |m| Seat {
                    member: m.clone(),
                    engine: e,
                })
            })
            .collect();
        // An engine whose shape is not known yet has no workers and serves no route.
        let http: Vec<&Engine> = (engines.iter().map(|e| &e.cfg))
            .filter(|e| e.http && e.shaped())
            .collect();
        Fleet {
            http: HttpShape {
                flavors: Flavors::of(http.iter().copied()),
                mixed_flavors: http.windows(2).any(|w| w[0].flavor != w[1].flavor),
                pins_in_body: http.iter().any(|e| e.flavor == Flavor::Sglang),
            },
            engines,
            workers,
        }
    }

    /// A fleet of config engines, for tests and `check`.
    pub fn expand(engines: Vec<Engine>) -> Fleet {
        Fleet::new(
            engines
                .into_iter()
                .map(|e| EngineEntry::new(e, Origin::Config, ConnLimits::default(), None))
                .collect(),
        )
    }

    /// Indices of engine `e`'s workers in [`Fleet::workers`] (they are contiguous).
    pub fn workers_of(&self, engine: usize) -> std::ops::Range<usize> {
        let start = self.workers.iter().position(|w| w.engine == engine);
        match start {
            Some(s) => s..s + self.engines[engine].members.len(),
            None => 0..0,
        }
    }
}

/// A vLLM engine polled through Prometheus, for unit tests across the crate: `start_rank` set,
/// so a member of the unnamed DP group, as such a config entry is.
#[cfg(test)]
pub fn test_engine(url: &str, dp_size: u32, start_rank: u32) -> Engine {
    Engine {
        url: url.into(),
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(url: &str, dp: u32, start: u32) -> Engine {
        test_engine(url, dp, start)
    }

    #[test]
    fn expands_to_global_ranks() {
        let fleet = Fleet::expand(vec![engine("http://a:1", 2, 0), engine("http://b:2", 3, 4)]);
        let ids: Vec<String> = fleet.workers.iter().map(|w| w.id.to_string()).collect();
        assert_eq!(
            ids,
            [
                "http://a:1@0",
                "http://a:1@1",
                "http://b:2@4",
                "http://b:2@5",
                "http://b:2@6"
            ]
        );
        assert_eq!(fleet.workers_of(1), 2..5);
    }

    #[test]
    fn parse_splits_on_last_at_only_before_digits() {
        let id = RankId::parse("http://user@h:80@12").unwrap();
        assert_eq!(&*id.engine, "http://user@h:80");
        assert_eq!(id.rank, Some(12));
        assert!(RankId::parse("http://h:80@x1").is_none());
        assert!(RankId::parse("http://h:80").is_none());
        assert!(RankId::parse("@1").is_none());
    }

    #[test]
    fn local_numbering_pins_node_local_index() {
        let mut e = engine("http://b:2", 2, 4);
        e.rank_header = RankNumbering::Local;
        let fleet = Fleet::expand(vec![e]);
        let pins: Vec<Option<u32>> = fleet.workers.iter().map(|w| w.pin_rank).collect();
        assert_eq!(pins, [Some(0), Some(1)]);
        assert_eq!(fleet.workers[1].id.rank, Some(5));
    }

    #[test]
    fn gateway_is_one_worker_without_rank() {
        let mut e = engine("http://gw:9", 1, 0);
        e.flavor = Flavor::Gateway;
        let fleet = Fleet::expand(vec![e]);
        assert_eq!(fleet.workers.len(), 1);
        assert_eq!(&*fleet.workers[0].id_text, "http://gw:9");
        assert_eq!(fleet.workers[0].pin_rank, None);
    }
}
