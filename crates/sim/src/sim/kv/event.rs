//! The KV-cache events a rank publishes and their wire form, as vLLM 0.32 writes them (checked
//! byte for byte against `tests/fixtures/vllm-0.32-kv-events/events-dp2.jsonl`).
//!
//! A message is three ZeroMQ frames: the topic, the sequence number (8 bytes, big-endian,
//! counting per rank from 0), and a msgpack payload `[ts: float64, [event, ...],
//! data_parallel_rank]`. Each event is a msgpack map whose first key is `"type"`, the other keys
//! in the engine's declaration order:
//! - `BlockStored`: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//!   lora_name, extra_keys (one entry per block), group_idx, kv_cache_spec_kind;
//! - `BlockRemoved`: block_hashes, medium, group_idx;
//! - `AllBlocksCleared`: no other key (the capture has none of these; vLLM declares the event
//!   without fields, so its map holds the tag alone).

use super::msgpack as mp;

/// Where blocks live; the sim only has GPU KV.
pub const MEDIUM_GPU: &str = "GPU";
/// The KV-cache spec of the sim's one attention group.
pub const FULL_ATTENTION: &str = "full_attention";

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks entered the cache: one hash per full block, chained from `parent_block_hash`
    /// (the block before the first, `None` at the start of a sequence); `token_ids` are the
    /// blocks' tokens, `block_size` per block.
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<u64>,
        medium: Option<String>,
        lora_name: Option<String>,
        group_idx: u32,
        kv_cache_spec_kind: String,
    },
    /// Blocks left the cache.
    BlockRemoved {
        block_hashes: Vec<u64>,
        medium: Option<String>,
        group_idx: u32,
    },
    /// Every block left the cache.
    AllBlocksCleared,
}

impl KvEvent {
    /// A `BlockStored` as the sim's GPU cache reports it (no LoRA, group 0, full attention).
    pub fn stored(
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
    ) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: None,
            medium: Some(MEDIUM_GPU.into()),
            lora_name: None,
            group_idx: 0,
            kv_cache_spec_kind: FULL_ATTENTION.into(),
        }
    }

    /// A `BlockRemoved` of the sim's GPU cache.
    pub fn removed(block_hashes: Vec<u64>) -> KvEvent {
        KvEvent::BlockRemoved {
            block_hashes,
            medium: Some(MEDIUM_GPU.into()),
            group_idx: 0,
        }
    }

    /// Appends the event's msgpack map.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                group_idx,
                kv_cache_spec_kind,
            } => {
                mp::map(out, 11);
                mp::str(out, "type");
                mp::str(out, "BlockStored");
                mp::str(out, "block_hashes");
                hashes(out, block_hashes);
                mp::str(out, "parent_block_hash");
                opt_uint(out, *parent_block_hash);
                mp::str(out, "token_ids");
                mp::array(out, token_ids.len());
                for &t in token_ids {
                    mp::uint(out, u64::from(t));
                }
                mp::str(out, "block_size");
                mp::uint(out, u64::from(*block_size));
                mp::str(out, "lora_id");
                opt_uint(out, *lora_id);
                mp::str(out, "medium");
                opt_str(out, medium.as_deref());
                mp::str(out, "lora_name");
                opt_str(out, lora_name.as_deref());
                // No multimodal inputs, cache salts or LoRA: every block's extra keys are nil.
                mp::str(out, "extra_keys");
                mp::array(out, block_hashes.len());
                for _ in block_hashes {
                    mp::nil(out);
                }
                mp::str(out, "group_idx");
                mp::uint(out, u64::from(*group_idx));
                mp::str(out, "kv_cache_spec_kind");
                mp::str(out, kv_cache_spec_kind);
            }
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            } => {
                mp::map(out, 4);
                mp::str(out, "type");
                mp::str(out, "BlockRemoved");
                mp::str(out, "block_hashes");
                hashes(out, block_hashes);
                mp::str(out, "medium");
                opt_str(out, medium.as_deref());
                mp::str(out, "group_idx");
                mp::uint(out, u64::from(*group_idx));
            }
            KvEvent::AllBlocksCleared => {
                mp::map(out, 1);
                mp::str(out, "type");
                mp::str(out, "AllBlocksCleared");
            }
        }
    }
}

fn hashes(out: &mut Vec<u8>, h: &[u64]) {
    mp::array(out, h.len());
    for &x in h {
        mp::uint(out, x);
    }
}

fn opt_uint(out: &mut Vec<u8>, v: Option<u64>) {
    match v {
        Some(v) => mp::uint(out, v),
        None => mp::nil(out),
    }
}

fn opt_str(out: &mut Vec<u8>, v: Option<&str>) {
    match v {
        Some(s) => mp::str(out, s),
        None => mp::nil(out),
    }
}

/// A batch's payload: `[ts, [events...], data_parallel_rank]`.
pub fn encode_batch(ts: f64, events: &[KvEvent], data_parallel_rank: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 96);
    mp::array(&mut out, 3);
    mp::float64(&mut out, ts);
    mp::array(&mut out, events.len());
    for e in events {
        e.encode(&mut out);
    }
    mp::uint(&mut out, u64::from(data_parallel_rank));
    out
}

/// Seconds since the Unix epoch, the batch's `ts` (Python's `time.time()`).
pub fn now_ts() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// The real capture (vLLM 0.32, DP=2), copied from the shared fixtures.
    fn capture() -> String {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/vllm-0.32-kv-events/events-dp2.jsonl"
        );
        std::fs::read_to_string(path).expect("the fixture is in the repo")
    }

    fn base64(s: &str) -> Vec<u8> {
        rankgate::kv::capture::base64(s).expect("the capture's frames are base64")
    }

    fn hashes(v: &Value) -> Vec<u64> {
        v.as_array()
            .expect("hash list")
            .iter()
            .map(|h| h.as_u64().expect("hash"))
            .collect()
    }

    fn opt_str(v: &Value) -> Option<String> {
        v.as_str().map(str::to_string)
    }

    /// The event a decoded JSON map describes, every key checked against the declared order.
    fn event(v: &Value) -> KvEvent {
        let m = v.as_object().expect("event map");
        match v["type"].as_str().expect("type") {
            "BlockStored" => {
                let n = m["block_hashes"].as_array().expect("hashes").len();
                let extra = m["extra_keys"].as_array().expect("extra keys");
                assert!(extra.len() == n && extra.iter().all(Value::is_null));
                KvEvent::BlockStored {
                    block_hashes: hashes(&m["block_hashes"]),
                    parent_block_hash: m["parent_block_hash"].as_u64(),
                    token_ids: (m["token_ids"].as_array().expect("tokens").iter())
                        .map(|t| u32::try_from(t.as_u64().expect("token")).expect("u32"))
                        .collect(),
                    block_size: m["block_size"].as_u64().expect("size") as u32,
                    lora_id: m["lora_id"].as_u64(),
                    medium: opt_str(&m["medium"]),
                    lora_name: opt_str(&m["lora_name"]),
                    group_idx: m["group_idx"].as_u64().expect("group") as u32,
                    kv_cache_spec_kind: opt_str(&m["kv_cache_spec_kind"]).expect("kind"),
                }
            }
            "BlockRemoved" => KvEvent::BlockRemoved {
                block_hashes: hashes(&m["block_hashes"]),
                medium: opt_str(&m["medium"]),
                group_idx: m["group_idx"].as_u64().expect("group") as u32,
            },
            "AllBlocksCleared" => KvEvent::AllBlocksCleared,
            other => panic!("unknown event {other}"),
        }
    }

    /// The batch's `ts` as written in the line: parsed by `str::parse`, which rounds exactly,
    /// rather than through a JSON number.
    fn ts(line: &str) -> f64 {
        let start = line.find("\"decoded\": [").expect("decoded") + "\"decoded\": [".len();
        let end = start + line[start..].find(',').expect("ts ends");
        line[start..end].trim().parse().expect("ts")
    }

    #[test]
    fn every_captured_payload_is_reencoded_byte_for_byte() {
        let text = capture();
        let mut kinds = std::collections::BTreeMap::new();
        let mut n = 0;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let v: Value = serde_json::from_str(line).expect("json line");
            let parts: Vec<Vec<u8>> = (v["parts_b64"].as_array().expect("parts").iter())
                .map(|p| base64(p.as_str().expect("b64")))
                .collect();
            assert_eq!(parts.len(), 3, "topic, sequence, payload");
            assert_eq!(parts[0], b"kv");
            let seq = v["seq"].as_u64().expect("seq");
            assert_eq!(parts[1], seq.to_be_bytes(), "8-byte big-endian sequence");
            let decoded = v["decoded"].as_array().expect("decoded");
            let events: Vec<KvEvent> = (decoded[1].as_array().expect("events").iter())
                .map(event)
                .collect();
            for e in &decoded[1].as_array().expect("events")[..] {
                *kinds
                    .entry(e["type"].as_str().unwrap_or("").to_string())
                    .or_insert(0) += 1;
            }
            let rank = decoded[2].as_u64().expect("rank") as u32;
            assert_eq!(u64::from(rank), v["rank_endpoint"].as_u64().expect("rank"));
            let mine = encode_batch(ts(line), &events, rank);
            assert_eq!(mine, parts[2], "payload of rank {rank} seq {seq}");
            n += 1;
        }
        assert_eq!(n, 44);
        assert_eq!(kinds["BlockRemoved"], 18);
    }

    #[test]
    fn the_sims_events_carry_the_captures_constants() {
        let mut a = Vec::new();
        KvEvent::stored(vec![1 << 40], None, vec![1; 4], 4).encode(&mut a);
        let s = String::from_utf8_lossy(&a);
        assert!(s.contains("GPU") && s.contains("full_attention"));
        let mut b = Vec::new();
        KvEvent::AllBlocksCleared.encode(&mut b);
        assert_eq!(b, b"\x81\xa4type\xb0AllBlocksCleared");
    }
}
