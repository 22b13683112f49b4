//! Native load reports (gRPC `GetLoads`, SGLang `/v1/loads`, a gateway's `/loads`) and their
//! projection onto ranks.
//!
//! All three speak the same shape: a list of per-rank entries keyed by GLOBAL `dp_rank`. An
//! engine's report is projected so that rank `r` gets exactly the one entry with `dp_rank == r`:
//! absent, duplicated or invalid entries make only that rank Unavailable, and nothing is ever
//! borrowed from another rank or from the aggregate. A gateway's report is different in kind:
//! its entries carry `worker` annotations and repeat `dp_rank`, so it is a fleet rollup, read as
//! one worker's load and never keyed as DP ranks.

use std::sync::Arc;

use tokio::time::Instant;

use crate::reason::{Reason, ReportKind};
use crate::table::{Fresh, Load, RankTelemetry};
pub use crate::wire::{Aggregate, LoadsReport, RankLoad};
use crate::worker::Engine;

/// What a projection found besides the per-rank states.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ProjectionNotes {
    /// Per rank of the engine: its entry was present but invalid (or duplicated).
    pub invalid: Vec<bool>,
    /// Entries naming a rank outside the engine's managed set.
    pub unmanaged: usize,
}

/// Projects an engine's report onto its ranks, in rank order.
pub fn project(
    report: &LoadsReport,
    engine: &Engine,
    sampled_at: Instant,
) -> (Vec<RankTelemetry>, ProjectionNotes) {
    let n = engine.dp_size as usize;
    let mut notes = ProjectionNotes {
        invalid: vec![false; n],
        unmanaged: 0,
    };
    if report.is_rollup() {
        return (
            vec![RankTelemetry::unavailable(Reason::FleetRollup); n],
            notes,
        );
    }
    if report.loads.is_empty() {
        // The real servicer omits ranks without a stats snapshot: a fresh engine's report is
        // empty, and its ranks fresh where the engine said it has them.
        let states = (engine.ranks())
            .map(|rank| match engine.names_rank(rank) {
                true => RankTelemetry::Available(Load::fresh(Fresh::Unproven, None, sampled_at)),
                false => RankTelemetry::unavailable(Reason::EmptyReport { gateway: false }),
            })
            .collect();
        return (states, notes);
    }
    let ranks = engine.ranks();
    notes.unmanaged = report
        .loads
        .iter()
        .filter(|l| {
            !l.dp_rank
                .is_some_and(|r| r >= ranks.start as i64 && r < ranks.end as i64)
        })
        .count();
    let capacity_divisor = summed_capacity_divisor(report);
    let states = ranks
        .enumerate()
        .map(|(i, rank)| {
            let mut entries = report
                .loads
                .iter()
                .filter(|l| l.dp_rank == Some(rank as i64));
            let (Some(entry), rest) = (entries.next(), entries.count()) else {
                // A rank without a stats snapshot is left out of the report; if the engine
                // itself said it has the rank, it is fresh (see `Fresh`).
                if engine.names_rank(rank) {
                    return RankTelemetry::Available(Load::fresh(
                        Fresh::Unproven,
                        None,
                        sampled_at,
                    ));
                }
                return RankTelemetry::unavailable(Reason::Absent {
                    rank,
                    report: ReportKind::Loads,
                });
            };
            if rest > 0 {
                notes.invalid[i] = true;
                return RankTelemetry::unavailable(Reason::Duplicate {
                    rank,
                    entries: rest + 1,
                });
            }
            if let Err(why) = entry.validate() {
                notes.invalid[i] = true;
                return RankTelemetry::unavailable(Reason::Invalid {
                    rank: Some(rank),
                    problem: why,
                });
            }
            RankTelemetry::Available(to_load(entry, capacity_divisor, sampled_at))
        })
        .collect();
    (states, notes)
}

/// The real servicer (smg-grpc-servicer 0.14.1 under vLLM 0.32) reports the SUM of the ranks'
/// capacities in every entry while `token_usage` is right. Cross-check on the entries that carry
/// used tokens: when `used / max` misses `token_usage` but `used / (max / n)` matches, divide.
fn summed_capacity_divisor(report: &LoadsReport) -> u64 {
    let n = report.loads.len() as f64;
    let mut votes = (0, 0);
    for l in &report.loads {
        if let (Some(used), Some(max), Some(u)) =
            (l.num_used_tokens, l.max_total_num_tokens, l.token_usage)
        {
            if used > 0 && max > 0 && u > 0.0 {
                let direct = used as f64 / max as f64;
                let split = direct * n;
                if (split - u).abs() < 0.02 && (direct - u).abs() >= 0.02 {
                    votes.0 += 1;
                } else {
                    votes.1 += 1;
                }
            }
        }
    }
    if votes.0 > 0 && votes.1 == 0 {
        report.loads.len() as u64
    } else {
        1
    }
}

fn count(v: Option<i64>) -> Option<u32> {
    v.map(|n| n.clamp(0, u32::MAX as i64) as u32)
}

fn to_load(l: &RankLoad, capacity_divisor: u64, sampled_at: Instant) -> Load {
    Load {
        kv_usage: l.token_usage.unwrap_or_default(),
        running: count(l.num_running_reqs),
        waiting: count(l.num_waiting_reqs),
        used_tokens: l.num_used_tokens.map(|n| n as u64),
        capacity_tokens: l
            .max_total_num_tokens
            .filter(|c| *c > 0)
            .map(|c| c as u64 / capacity_divisor),
        aggregate: false,
        upstream: None,
        prefix_cache: None,
        fresh: None,
        sampled_at,
    }
}

/// Reads an upstream gateway's rollup as ONE worker's load: the aggregate's KV usage when given,
/// else the mean over its entries. The entries are kept, annotations and all, for `/workers`.
pub fn rollup(report: &LoadsReport, sampled_at: Instant) -> RankTelemetry {
    let valid: Vec<&RankLoad> = report
        .loads
        .iter()
        .filter(|l| l.validate().is_ok())
        .collect();
    if valid.is_empty() {
        return RankTelemetry::unavailable(if report.loads.is_empty() {
            Reason::EmptyReport { gateway: true }
        } else {
            Reason::Invalid {
                rank: None,
                problem: format!(
                    "none of the gateway's {} entries is valid",
                    report.loads.len()
                ),
            }
        });
    }
    let agg = report.aggregate.as_ref();
    let mean = valid.iter().filter_map(|l| l.token_usage).sum::<f64>() / valid.len() as f64;
    let kv = agg.and_then(|a| a.avg_token_usage).unwrap_or(mean);
    if !(0.0..=1.0).contains(&kv) {
        return RankTelemetry::unavailable(Reason::Invalid {
            rank: None,
            problem: format!("rollup avg_token_usage {kv} outside [0, 1]"),
        });
    }
    let sum = |f: fn(&RankLoad) -> Option<i64>| valid.iter().filter_map(|l| f(l)).sum::<i64>();
    let running = agg
        .and_then(|a| a.total_running_reqs)
        .unwrap_or_else(|| sum(|l| l.num_running_reqs));
    let waiting = agg
        .and_then(|a| a.total_waiting_reqs)
        .unwrap_or_else(|| sum(|l| l.num_waiting_reqs));
    RankTelemetry::Available(Load {
        kv_usage: kv,
        running: count(Some(running)),
        waiting: count(Some(waiting)),
        used_tokens: None,
        capacity_tokens: None,
        aggregate: true,
        upstream: Some(Arc::from(report.loads.clone())),
        prefix_cache: None,
        fresh: None,
        sampled_at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry(rank: i64, usage: f64) -> RankLoad {
        RankLoad {
            dp_rank: Some(rank),
            num_running_reqs: Some(1),
            num_waiting_reqs: Some(0),
            token_usage: Some(usage),
            ..RankLoad::default()
        }
    }

    fn engine(dp: u32, start: u32) -> Engine {
        crate::worker::test_engine("http://e:1", dp, start)
    }

    fn kv(t: &RankTelemetry) -> Option<f64> {
        match t {
            RankTelemetry::Available(l) => Some(l.kv_usage),
            RankTelemetry::Unavailable { .. } => None,
        }
    }

    #[test]
    fn each_rank_gets_exactly_its_own_entry() {
        let r = LoadsReport {
            loads: vec![entry(5, 0.5), entry(4, 0.4), entry(9, 0.9)],
            ..Default::default()
        };
        let (states, notes) = project(&r, &engine(3, 4), Instant::now());
        assert_eq!(
            states.iter().map(kv).collect::<Vec<_>>(),
            [Some(0.4), Some(0.5), None]
        );
        assert_eq!(notes.unmanaged, 1);
        assert!(
            matches!(&states[2], RankTelemetry::Unavailable { reason } if reason.to_string().contains("rank 6 absent"))
        );
    }

    #[test]
    fn invalid_and_duplicate_entries_only_hit_their_rank() {
        let mut neg = entry(2, 0.2);
        neg.num_running_reqs = Some(-1);
        let r = LoadsReport {
            loads: vec![
                entry(0, f64::NAN),
                entry(1, 0.1),
                entry(1, 0.2),
                neg,
                entry(3, 1.5),
                entry(4, 0.3),
            ],
            ..Default::default()
        };
        let (states, notes) = project(&r, &engine(5, 0), Instant::now());
        assert_eq!(
            states.iter().map(kv).collect::<Vec<_>>(),
            [None, None, None, None, Some(0.3)]
        );
        assert_eq!(notes.invalid, [true, true, true, true, false]);
        let reasons: Vec<String> = states
            .iter()
            .filter_map(|s| match s {
                RankTelemetry::Unavailable { reason } => Some(reason.to_string()),
                _ => None,
            })
            .collect();
        assert!(
            reasons[0].contains("NaN")
                && reasons[1].contains("duplicate")
                && reasons[2].contains("negative")
        );
        assert!(reasons[3].contains("outside"));
    }

    #[test]
    fn rollup_is_never_keyed_as_ranks() {
        let body = br#"{"loads":[{"worker":"http://a:1","dp_rank":0,"token_usage":0.2},{"worker":"http://b:1","dp_rank":0,"token_usage":0.6}],
            "aggregate":{"total_running_reqs":3,"total_waiting_reqs":1,"avg_token_usage":0.4}}"#;
        let r = LoadsReport::from_json(body).unwrap();
        let (states, _) = project(&r, &engine(2, 0), Instant::now());
        assert!(states.iter().all(|s| kv(s).is_none()));
        match rollup(&r, Instant::now()) {
            RankTelemetry::Available(l) => {
                assert_eq!(l.kv_usage, 0.4);
                assert_eq!(l.running, Some(3));
                assert!(l.aggregate);
                assert_eq!(l.upstream.unwrap()[1].worker.as_deref(), Some("http://b:1"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn json_entries_are_read_one_by_one() {
        let body = br#"{"dp_rank_count":2,"loads":[{"dp_rank":0,"token_usage":"lots"},{"dp_rank":1,"token_usage":0.25,"num_used_tokens":100,"max_total_num_tokens":400}]}"#;
        let r = LoadsReport::from_json(body).unwrap();
        let (states, notes) = project(&r, &engine(2, 0), Instant::now());
        assert_eq!(kv(&states[0]), None);
        assert_eq!(notes.invalid, [true, false]);
        match &states[1] {
            RankTelemetry::Available(l) => {
                assert_eq!((l.used_tokens, l.capacity_tokens), (Some(100), Some(400)))
            }
            other => panic!("{other:?}"),
        }
        assert!(LoadsReport::from_json(b"{}").is_err());
        assert!(LoadsReport::from_json(b"not json").is_err());
    }

    #[test]
    fn summed_capacity_is_split_per_rank() {
        // Each rank really holds 1000 tokens, 250 used; the servicer reports max = 2000.
        let mk = |rank| RankLoad {
            num_used_tokens: Some(250),
            max_total_num_tokens: Some(2000),
            ..entry(rank, 0.25)
        };
        let r = LoadsReport {
            loads: vec![mk(0), mk(1)],
            ..Default::default()
        };
        let (states, _) = project(&r, &engine(2, 0), Instant::now());
        match &states[0] {
            RankTelemetry::Available(l) => assert_eq!(l.capacity_tokens, Some(1000)),
            other => panic!("{other:?}"),
        }
    }

    proptest! {
        /// Arbitrary bytes, or arbitrary JSON values in the entries, never panic the reader.
        #[test]
        fn reading_never_panics(body in proptest::collection::vec(any::<u8>(), 0..200), x in any::<f64>(), n in any::<i64>()) {
            let _ = LoadsReport::from_json(&body);
            let doc = format!(r#"{{"loads":[{{"dp_rank":{n},"token_usage":{x}}},{{"dp_rank":"{x}"}},7,null],"aggregate":{{"avg_token_usage":{n}}}}}"#);
            if let Ok(r) = LoadsReport::from_json(doc.as_bytes()) {
                let _ = project(&r, &engine(2, 0), Instant::now());
                let _ = rollup(&r, Instant::now());
            }
        }

        /// Whatever the entries, a rank is Available only with its own valid entry's usage.
        #[test]
        fn projection_never_borrows_another_ranks_numbers(
            entries in proptest::collection::vec((0i64..6, prop_oneof![0.0f64..=1.0, Just(f64::NAN), Just(2.0)]), 0..10)
        ) {
            let r = LoadsReport {
                loads: entries.iter().map(|(rank, u)| entry(*rank, *u)).collect(),
                ..Default::default()
            };
            let (states, _) = project(&r, &engine(4, 1), Instant::now());
            for (i, s) in states.iter().enumerate() {
                let rank = i as i64 + 1;
                let own: Vec<f64> = entries.iter().filter(|(r, _)| *r == rank).map(|(_, u)| *u).collect();
                match kv(s) {
                    Some(k) => prop_assert!(own.len() == 1 && own[0] == k),
                    None => prop_assert!(own.len() != 1 || !(0.0..=1.0).contains(&own[0])),
                }
            }
        }
    }
}
