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

// The engine types are the config's (it sits below everything); re-exported so that the fleet's
// users name them with the fleet.
#[cfg(test)]
pub use crate::config::test_engine;
pub use crate::config::{
    ApiKey, Declared, Deployment, Engine, Flavor, Flavors, RankNumbering, Reported, Role,
    TelemetrySource,
};
use crate::ix::{EngineIx, Ix, IxVec, WorkerIx};
use crate::live::Live;
use crate::metrics::counts::{PollCounters, WorkerCounters};
use crate::upstream::{ConnLimits, EngineConn};

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
    /// The same as an `x-rankgate-worker` header value (`server.expose_worker = "url"`).
    pub header: HeaderValue,
    /// `<name>@<rank>` for an engine with a `name`, as clients are told it under
    /// `server.expose_worker = "name"`; `None`: clients learn nothing of this worker.
    pub named: Option<HeaderValue>,
    /// Value of the pinning header / body field, per the engine's numbering; `None` for a
    /// gateway, which routes by itself.
    pub pin_rank: Option<u32>,
    pub pin_header: Option<HeaderValue>,
    /// Its engine's part in a disaggregated model (`engines[].role`).
    pub role: Role,
    pub live: Live,
    pub counters: WorkerCounters,
    /// Polls in which the rank's entry was present but invalid or duplicated.
    pub invalid_entries: AtomicU64,
    /// Prompt prefixes recently sent here (`routing.prefix_affinity`).
    pub prefixes: crate::prefix::RankPrefixes,
    /// The blocks its engine says it holds (`routing.kv_events`), read by picks without a
    /// lock, written by its engine's event feed.
    pub kv: Arc<crate::kv::RankIndex>,
    /// The LoRA adapters this router has requests in flight for here.
    pub adapters: crate::adapters::Adapters,
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
        let role = cfg.role;
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
                // Names are validated header-safe, as are URLs.
                let named = cfg.name.as_ref().and_then(|n| {
                    let text = match id.rank {
                        Some(r) => format!("{n}@{r}"),
                        None => n.to_string(),
                    };
                    HeaderValue::from_str(&text).ok()
                });
                let same = prev.into_iter().flat_map(|p| p.members.iter()).find(|m| {
                    m.id == id && m.pin_rank == pin_rank && m.named == named && m.role == role
                });
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
                    named,
                    pin_rank,
                    pin_header: pin_rank.map(HeaderValue::from),
                    role,
                    live: Live::default(),
                    counters: WorkerCounters::default(),
                    invalid_entries: AtomicU64::new(0),
                    prefixes: Default::default(),
                    adapters: Default::default(),
                    kv: Default::default(),
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
    pub engine: EngineIx,
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
    pub engines: IxVec<EngineIx, Arc<EngineEntry>>,
    pub workers: IxVec<WorkerIx, Seat>,
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
    /// Some engine is a prefill or decode server: requests are then looked at for their model
    /// and route, to be split into two legs where the model is served disaggregated.
    pub disaggregated: bool,
}

impl Fleet {
    pub fn new(engines: Vec<Arc<EngineEntry>>) -> Fleet {
        let engines: IxVec<EngineIx, _> = engines.into();
        let workers = (engines.iter_enumerated())
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
                disaggregated: (engines.iter()).any(|e| e.cfg.http && e.cfg.role.disaggregated()),
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

    /// Engine `e`'s workers in [`Fleet::workers`] (they are contiguous).
    pub fn workers_of(&self, engine: EngineIx) -> impl Iterator<Item = WorkerIx> + use<> {
        // Workers are in engine order: a binary search, not a scan (this runs for every poll
        // report, and fleets run to tens of thousands of ranks).
        let start = self
            .workers
            .iter()
            .as_slice()
            .partition_point(|w| w.engine < engine);
        let range = match self.workers.iter().as_slice().get(start) {
            Some(w) if w.engine == engine => start..start + self.engines[engine].members.len(),
            _ => 0..0,
        };
        range.map(WorkerIx::new)
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
        let of = |e| fleet.workers_of(EngineIx::new(e)).collect::<Vec<_>>();
        assert_eq!(of(1), (2..5).map(WorkerIx::new).collect::<Vec<_>>());
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
        assert_eq!(fleet.workers[WorkerIx::new(1)].id.rank, Some(5));
    }

    #[test]
    fn gateway_is_one_worker_without_rank() {
        let mut e = engine("http://gw:9", 1, 0);
        e.flavor = Flavor::Gateway;
        let fleet = Fleet::expand(vec![e]);
        assert_eq!(fleet.workers.len(), 1);
        let first = &fleet.workers[WorkerIx::new(0)];
        assert_eq!(&*first.id_text, "http://gw:9");
        assert_eq!(first.pin_rank, None);
    }
}
