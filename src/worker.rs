//! Virtual workers: the identity `<base-url>@<global rank>` and the expansion of engines into them.
//!
//! An engine serving `dp_size` data-parallel ranks becomes `dp_size` virtual workers. The `@rank`
//! suffix is identity only: every outbound request goes to the engine's base URL, so the id is a
//! typed pair and never a string that someone parses back into a URL (a URL parser reads
//! `http://h:p@3` as user `h:p` at host `3`).

use std::fmt;
use std::sync::Arc;

use serde::Deserialize;

/// Which engine family serves a rank; decides how a request is pinned and how telemetry is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Flavor {
    Vllm,
    Sglang,
}

impl Flavor {
    pub fn as_str(self) -> &'static str {
        match self {
            Flavor::Vllm => "vllm",
            Flavor::Sglang => "sglang",
        }
    }
}

impl fmt::Display for Flavor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
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

/// One engine (one server process hosting one or more DP ranks), as the config describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Engine {
    /// Base URL without trailing slash, e.g. `http://127.0.0.1:8000`.
    pub url: Arc<str>,
    /// `host:port` authority of `url`, kept for building upstream URIs without re-parsing.
    pub authority: Arc<str>,
    pub flavor: Flavor,
    pub dp_size: u32,
    pub start_rank: u32,
    pub rank_header: RankNumbering,
}

impl Engine {
    /// Global ranks this engine manages: `start_rank .. start_rank + dp_size`.
    pub fn ranks(&self) -> std::ops::Range<u32> {
        self.start_rank..self.start_rank + self.dp_size
    }
}

/// Identity of a virtual worker: one DP rank of one engine, displayed `engine@rank`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RankId {
    pub engine: Arc<str>,
    /// Global DP rank.
    pub rank: u32,
}

impl fmt::Display for RankId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.engine, self.rank)
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
            rank: rank.parse().ok()?,
        })
    }
}

/// A virtual worker: its id, the engine it lives on and its index in the fleet tables.
#[derive(Debug, Clone)]
pub struct Worker {
    pub id: RankId,
    /// The id pre-rendered once, since every proxied response carries it in a header.
    pub id_text: Arc<str>,
    /// Index of the engine in [`Fleet::engines`].
    pub engine: usize,
    /// Value of the pinning header / body field, per the engine's numbering.
    pub pin_rank: u32,
}

/// The static shape of the fleet: engines and their virtual workers, in config order.
#[derive(Debug, Clone)]
pub struct Fleet {
    pub engines: Vec<Engine>,
    pub workers: Vec<Worker>,
}

impl Fleet {
    /// Expands every engine into one worker per global rank.
    pub fn expand(engines: Vec<Engine>) -> Fleet {
        let mut workers = Vec::new();
        for (e, engine) in engines.iter().enumerate() {
            for rank in engine.ranks() {
                let id = RankId {
                    engine: engine.url.clone(),
                    rank,
                };
                let pin_rank = match engine.rank_header {
                    RankNumbering::Global => rank,
                    RankNumbering::Local => rank - engine.start_rank,
                };
                workers.push(Worker {
                    id_text: id.to_string().into(),
                    id,
                    engine: e,
                    pin_rank,
                });
            }
        }
        Fleet { engines, workers }
    }

    /// Indices of `engine`'s workers in [`Fleet::workers`] (they are contiguous).
    pub fn workers_of(&self, engine: usize) -> std::ops::Range<usize> {
        let start = self.workers.iter().position(|w| w.engine == engine);
        match start {
            Some(s) => s..s + self.engines[engine].dp_size as usize,
            None => 0..0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(url: &str, dp: u32, start: u32) -> Engine {
        Engine {
            url: url.into(),
            authority: url.trim_start_matches("http://").into(),
            flavor: Flavor::Vllm,
            dp_size: dp,
            start_rank: start,
            rank_header: RankNumbering::Global,
        }
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
        assert_eq!(id.rank, 12);
        assert!(RankId::parse("http://h:80@x1").is_none());
        assert!(RankId::parse("http://h:80").is_none());
        assert!(RankId::parse("@1").is_none());
    }

    #[test]
    fn local_numbering_pins_node_local_index() {
        let mut e = engine("http://b:2", 2, 4);
        e.rank_header = RankNumbering::Local;
        let fleet = Fleet::expand(vec![e]);
        let pins: Vec<u32> = fleet.workers.iter().map(|w| w.pin_rank).collect();
        assert_eq!(pins, [0, 1]);
        assert_eq!(fleet.workers[1].id.rank, 5);
    }
}
