//! The real capture (`tests/fixtures/vllm-0.32-kv-events/events-dp2.jsonl`: every message a
//! vLLM 0.32 DP=2 engine published over two 3-turn chats and an eviction burst) decoded and
//! replayed into each rank's index.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use serde_json::Value;

use super::event::{decode, Event};
use super::hash::chain;
use super::index::RankIndex;
use super::state::KvState;
use super::writer::Writer;

const CAPTURE: &str =
    include_str!("../../../../tests/fixtures/vllm-0.32-kv-events/events-dp2.jsonl");

/// Each line's rank, frames and JSON.
fn capture() -> Vec<(u32, Vec<Vec<u8>>, Value)> {
    (super::capture::read(CAPTURE).unwrap().into_iter())
        .map(|r| (r.rank, r.frames, r.line))
        .collect()
}

#[test]
fn every_captured_message_decodes_as_the_engine_wrote_it() {
    let all = capture();
    assert_eq!(all.len(), 44);
    for (rank, frames, line) in &all {
        let m = decode(frames).unwrap();
        let decoded = &line["decoded"];
        assert_eq!(m.topic, b"kv");
        assert_eq!(m.seq, line["seq"].as_u64().unwrap());
        assert_eq!(m.batch.dp_rank, Some(*rank));
        // The JSON's float is the payload's to within its printing.
        assert!((m.batch.ts - decoded[0].as_f64().unwrap()).abs() < 1e-6);
        let events = decoded[1].as_array().unwrap();
        assert_eq!(m.batch.events.len(), events.len());
        for (e, want) in m.batch.events.iter().zip(events) {
            let hashes = |v: &Value| -> Vec<u64> {
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|h| h.as_u64().unwrap())
                    .collect()
            };
            match (e, want["type"].as_str().unwrap()) {
                (
                    Event::Stored {
                        hashes: h,
                        parent,
                        tokens,
                        block_size,
                        special,
                    },
                    "BlockStored",
                ) => {
                    assert_eq!(*h, hashes(&want["block_hashes"]));
                    assert_eq!(*parent, want["parent_block_hash"].as_u64());
                    let t: Vec<u32> = serde_json::from_value(want["token_ids"].clone()).unwrap();
                    assert_eq!(*tokens, t);
                    assert_eq!(u64::from(*block_size), want["block_size"].as_u64().unwrap());
                    assert!(!special, "plain GPU blocks of the base model");
                }
                (
                    Event::Removed {
                        hashes: h,
                        other_medium,
                    },
                    "BlockRemoved",
                ) => {
                    assert_eq!(*h, hashes(&want["block_hashes"]));
                    assert!(!other_medium);
                }
                (e, t) => panic!("{t} decoded as {e:?}"),
            }
        }
    }
}

#[test]
fn replayed_each_ranks_index_holds_exactly_the_engines_blocks() {
    // Expected, from the decoded JSON alone: per rank, engine hash -> its name, stores minus
    // removals.
    let mut want: HashMap<u32, HashMap<u64, u64>> = HashMap::new();
    for (rank, _, line) in capture() {
        let held = want.entry(rank).or_default();
        for e in line["decoded"][1].as_array().unwrap() {
            let hashes: Vec<u64> = serde_json::from_value(e["block_hashes"].clone()).unwrap();
            if e["type"] == "BlockStored" {
                let tokens: Vec<u32> = serde_json::from_value(e["token_ids"].clone()).unwrap();
                let bs = e["block_size"].as_u64().unwrap() as usize;
                let mut parent = e["parent_block_hash"].as_u64().map(|p| held[&p]);
                for (h, block) in hashes.iter().zip(tokens.chunks(bs)) {
                    let name = chain(parent, block);
                    held.insert(*h, name);
                    parent = Some(name);
                }
            } else {
                for h in hashes {
                    held.remove(&h);
                }
            }
        }
    }
    let mut writers: HashMap<u32, Writer> = HashMap::new();
    for (rank, frames, _) in capture() {
        let w = writers
            .entry(rank)
            .or_insert_with(|| Writer::new(Arc::new(RankIndex::default())));
        w.apply(&decode(&frames).unwrap());
    }
    for (rank, held) in &want {
        let index = writers[rank].index();
        let names: HashSet<u64> = held.values().copied().collect();
        // The capture starts at sequence 3 (rankgate joined late): the index is a lower bound,
        // used by picks, holding what it saw.
        assert!(
            matches!(index.state(), KvState::Available { partial: Some(ref p), .. } if p.why.contains("joined")),
            "{:?}",
            index.state()
        );
        for n in &names {
            assert_eq!(
                index.matched_blocks(&[*n]),
                1,
                "rank {rank}: a held block is indexed"
            );
        }
        let stored = index
            .counts
            .stored
            .load(std::sync::atomic::Ordering::Relaxed);
        let removed = index
            .counts
            .removed
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            stored - removed,
            names.len() as u64,
            "rank {rank}: stores minus removals"
        );
    }
    let removed = |r: u32| {
        writers[&r]
            .index()
            .counts
            .removed
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    // Rank 0 evicted 18 blocks; 4 of them were stored before the capture began (sequences
    // 0-2), so the index never held them.
    assert_eq!((removed(0), removed(1)), (14, 0));
}

#[test]
fn sglangs_array_form_without_a_rank_decodes() {
    // SGLang's batch: [ts, [["BlockStored", [5], nil, [1, 2], 2, nil], ["BlockRemoved", [5]],
    // ["AllBlocksCleared"]]]: tagged arrays, and no data_parallel_rank.
    let mut p = vec![0x92, 0xcb];
    p.extend_from_slice(&1.5f64.to_be_bytes());
    p.push(0x93);
    p.extend_from_slice(&[0x96, 0xab]);
    p.extend_from_slice(b"BlockStored");
    p.extend_from_slice(&[0x91, 0x05, 0xc0, 0x92, 0x01, 0x02, 0x02, 0xc0]);
    p.extend_from_slice(&[0x92, 0xac]);
    p.extend_from_slice(b"BlockRemoved");
    p.extend_from_slice(&[0x91, 0x05, 0x91, 0xb0]);
    p.extend_from_slice(b"AllBlocksCleared");
    let b = super::event::decode_batch(&p).unwrap();
    assert_eq!((b.ts, b.dp_rank), (1.5, None));
    assert_eq!(
        b.events,
        [
            Event::Stored {
                hashes: vec![5],
                parent: None,
                tokens: vec![1, 2],
                block_size: 2,
                special: false
            },
            Event::Removed {
                hashes: vec![5],
                other_medium: false
            },
            Event::AllCleared,
        ]
    );
}

#[test]
fn a_salted_sglang_store_is_read_whole_and_left_out() {
    // ["BlockStored", [7], nil, [1, 2], 2, nil, "GPU", {"cache_salt": "s"}], then a removal:
    // the metadata map is skipped whole and marks the block special.
    let mut p = vec![0x93, 0x00, 0x92, 0x98, 0xab];
    p.extend_from_slice(b"BlockStored");
    p.extend_from_slice(&[0x91, 0x07, 0xc0, 0x92, 0x01, 0x02, 0x02, 0xc0, 0xa3]);
    p.extend_from_slice(b"GPU");
    p.extend_from_slice(&[0x81, 0xaa]);
    p.extend_from_slice(b"cache_salt");
    p.extend_from_slice(&[0xa1, b's', 0x93, 0xac]);
    p.extend_from_slice(b"BlockRemoved");
    p.extend_from_slice(&[0x91, 0x07, 0xa3]);
    p.extend_from_slice(b"GPU");
    p.push(0x03);
    let b = super::event::decode_batch(&p).unwrap();
    assert_eq!(b.dp_rank, Some(3));
    assert!(
        matches!(b.events[0], Event::Stored { special: true, .. }),
        "{:?}",
        b.events[0]
    );
    assert_eq!(
        b.events[1],
        Event::Removed {
            hashes: vec![7],
            other_medium: false
        }
    );
}
