//! One message of an engine's KV-event publisher, decoded: ZeroMQ frames `[topic, sequence
//! (8 bytes, big-endian), payload]`, the payload a msgpack `[timestamp, [event, ...],
//! data_parallel_rank]` (vLLM 0.32; `tests/fixtures/vllm-0.32-kv-events`). Events are msgpack
//! maps with a `"type"` (vLLM 0.32) or, from older engines, arrays whose first element is the
//! type; both read. Unknown event types and fields are skipped, not fatal: a newer engine's
//! extras must not blind the index.
//!
//! Blocks that are not plain token blocks of the base model (a LoRA's, ones with `extra_keys`
//! such as multimodal inputs, or blocks offloaded to another `medium` than the GPU) never
//! match a plain prompt's blocks, so they are marked here and left out of the index.

use super::msgpack::{MsgpackError, Reader, Value};

/// A payload longer than this is refused, and its frame with it before a byte of it is read
/// (`feed.rs` passes this bound to the ZMTP reader). Sized to real batches: the capture's
/// largest (`tests/fixtures/vllm-0.32-kv-events`, vLLM 0.32) is 1,099 bytes for 384 token ids,
/// about 3 bytes a token; a batch carries the blocks one engine step stored, so its tokens are
/// bounded by the step's scheduled tokens (`--max-num-batched-tokens`, 2-16 K usually). At 5
/// bytes a token (ids past 65,535) plus 9 a block hash, 1 MiB holds a step of about 200 K
/// tokens: ample headroom, and 32 times less than a stalled stranger could once pin.
pub const MAX_PAYLOAD: usize = 1 << 20;
/// Events in one batch, and token ids in one event, at most.
const MAX_EVENTS: usize = 1 << 20;

/// An engine's name for a block: its integer hash, or a digest of its bytes hash (vLLM sends
/// bytes with some hash settings), folded to 64 bits; used only to follow the engine's own
/// references (`parent_block_hash`, removals).
pub type EngineHash = u64;

/// One decoded message.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub topic: Vec<u8>,
    pub seq: u64,
    pub batch: Batch,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub ts: f64,
    pub events: Vec<Event>,
    /// The publishing rank (global), when the engine says.
    pub dp_rank: Option<u32>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Stored {
        hashes: Vec<EngineHash>,
        parent: Option<EngineHash>,
        tokens: Vec<u32>,
        block_size: u32,
        /// A LoRA's, multimodal, or not on the GPU: not comparable with a plain prompt.
        special: bool,
    },
    Removed {
        hashes: Vec<EngineHash>,
        /// Removed from another medium than the GPU (the GPU copy is not affected).
        other_medium: bool,
    },
    AllCleared,
    /// A type this reader does not know (skipped).
    Other,
}

/// Why a message could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("{0} frames: a KV-event message has 3 (topic, sequence, payload)")]
    Frames(usize),
    #[error("sequence frame of {0} bytes: it is 8 (big-endian)")]
    Sequence(usize),
    #[error("payload of {0} bytes is over the {MAX_PAYLOAD}-byte limit")]
    TooLarge(usize),
    #[error("payload: {0}")]
    Payload(#[from] MsgpackError),
}

/// Decodes one message's frames.
pub fn decode(frames: &[impl AsRef<[u8]>]) -> Result<Message, DecodeError> {
    let [topic, seq, payload] = frames else {
        return Err(DecodeError::Frames(frames.len()));
    };
    let seq: [u8; 8] = (seq.as_ref())
        .try_into()
        .map_err(|_| DecodeError::Sequence(seq.as_ref().len()))?;
    Ok(Message {
        topic: topic.as_ref().to_vec(),
        seq: u64::from_be_bytes(seq),
        batch: decode_batch(payload.as_ref())?,
    })
}

/// Decodes a payload `[ts, [events], dp_rank]` (`dp_rank` may be absent in older engines).
pub fn decode_batch(payload: &[u8]) -> Result<Batch, DecodeError> {
    if payload.len() > MAX_PAYLOAD {
        return Err(DecodeError::TooLarge(payload.len()));
    }
    let mut r = Reader::new(payload);
    let n = r.array("batch")?;
    if !(2..=3).contains(&n) {
        return Err(r
            .error(format!(
                "batch: {n} elements, expected [ts, events, dp_rank]"
            ))
            .into());
    }
    let ts = match r.value()? {
        Value::Float(f) => f,
        Value::Uint(u) => u as f64,
        Value::Int(i) => i as f64,
        v => return Err(r.error(format!("batch timestamp: {v:?}")).into()),
    };
    let count = r.array("events")?;
    if count > MAX_EVENTS {
        return Err(r.error(format!("{count} events in one batch")).into());
    }
    let mut events = Vec::with_capacity(count);
    for _ in 0..count {
        events.push(event(&mut r)?);
    }
    let dp_rank = match n {
        3 => match r.value()? {
            Value::Nil => None,
            Value::Uint(u) => {
                Some(u32::try_from(u).map_err(|_| r.error("data_parallel_rank over u32"))?)
            }
            v => return Err(r.error(format!("data_parallel_rank: {v:?}")).into()),
        },
        _ => None,
    };
    Ok(Batch {
        ts,
        events,
        dp_rank,
    })
}

/// The fields an event may have, by name or (older array form) position.
#[derive(Default)]
struct Fields {
    kind: Option<String>,
    hashes: Option<Vec<EngineHash>>,
    parent: Option<EngineHash>,
    tokens: Option<Vec<u32>>,
    block_size: Option<u32>,
    special: bool,
    other_medium: bool,
}

fn event(r: &mut Reader) -> Result<Event, MsgpackError> {
    let mut f = Fields::default();
    match r.value()? {
        Value::Map(n) => {
            for _ in 0..n {
                let key = match r.value()? {
                    Value::Str(k) => k,
                    v => return Err(r.error(format!("event key: {v:?}"))),
                };
                field(r, &mut f, key)?;
            }
        }
        // [type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]
        // for stores; [type, block_hashes, medium] for removals.
        Value::Array(n) => {
            let names_stored = [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                // SGLang's stores may carry a metadata map here (a cache salt): salted blocks
                // are not a plain prompt's (`extra_keys` marks them special).
                "extra_keys",
            ];
            let names_removed = ["type", "block_hashes", "medium"];
            let mut names: &[&str] = &names_stored;
            for i in 0..n {
                if i == 1 && f.kind.as_deref() == Some("BlockRemoved") {
                    names = &names_removed;
                }
                match names.get(i) {
                    Some(k) => field(r, &mut f, k)?,
                    None => r.skip()?,
                }
            }
        }
        v => return Err(r.error(format!("event: expected a map or array, got {v:?}"))),
    }
    let missing = |what: &str| {
        r.error(format!(
            "{:?} event without {what}",
            f.kind.as_deref().unwrap_or("")
        ))
    };
    Ok(match f.kind.as_deref() {
        Some("BlockStored") => Event::Stored {
            hashes: f.hashes.take().ok_or_else(|| missing("block_hashes"))?,
            parent: f.parent,
            tokens: f.tokens.take().ok_or_else(|| missing("token_ids"))?,
            block_size: f.block_size.ok_or_else(|| missing("block_size"))?,
            special: f.special || f.other_medium,
        },
        Some("BlockRemoved") => Event::Removed {
            hashes: f.hashes.take().ok_or_else(|| missing("block_hashes"))?,
            other_medium: f.other_medium,
        },
        Some("AllBlocksCleared") => Event::AllCleared,
        Some(_) => Event::Other,
        None => return Err(r.error("event without a type")),
    })
}

fn field(r: &mut Reader, f: &mut Fields, key: &str) -> Result<(), MsgpackError> {
    match key {
        "type" => match r.value()? {
            Value::Str(s) => f.kind = Some(s.to_string()),
            v => return Err(r.error(format!("event type: {v:?}"))),
        },
        "block_hashes" => {
            let n = r.array("block_hashes")?;
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(engine_hash(r)?.ok_or_else(|| r.error("block_hashes: a null hash"))?);
            }
            f.hashes = Some(v);
        }
        "parent_block_hash" => f.parent = engine_hash(r)?,
        "token_ids" => {
            let n = r.array("token_ids")?;
            if n > MAX_EVENTS {
                return Err(r.error(format!("{n} token ids in one event")));
            }
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                let t = r.uint("token id")?;
                v.push(u32::try_from(t).map_err(|_| r.error(format!("token id {t} over u32")))?);
            }
            f.tokens = Some(v);
        }
        "block_size" => {
            let b = r.uint("block_size")?;
            f.block_size = Some(
                u32::try_from(b)
                    .ok()
                    .filter(|b| *b > 0)
                    .ok_or_else(|| r.error(format!("block_size {b}")))?,
            );
        }
        "lora_id" | "lora_name" => {
            let v = r.value()?;
            f.special |= !matches!(v, Value::Nil);
            skip_body(r, v)?;
        }
        "medium" => match r.value()? {
            Value::Nil => {}
            Value::Str(m) => f.other_medium |= !m.eq_ignore_ascii_case("gpu"),
            v => return Err(r.error(format!("medium: {v:?}"))),
        },
        "extra_keys" => match r.value()? {
            Value::Nil => {}
            Value::Array(n) => {
                for _ in 0..n {
                    match r.value()? {
                        Value::Nil => {}
                        Value::Array(m) => {
                            f.special = true;
                            (0..m).try_for_each(|_| r.skip())?;
                        }
                        Value::Map(m) => {
                            f.special = true;
                            (0..2 * m).try_for_each(|_| r.skip())?;
                        }
                        _ => f.special = true,
                    }
                }
            }
            v => {
                f.special = true;
                skip_body(r, v)?;
            }
        },
        _ => r.skip()?,
    }
    Ok(())
}

/// Skips what follows a container's head `v` (its elements), so a field of an unexpected shape
/// never leaves the reader inside it.
fn skip_body(r: &mut Reader, v: Value) -> Result<(), MsgpackError> {
    match v {
        Value::Array(n) => (0..n).try_for_each(|_| r.skip()),
        Value::Map(n) => (0..2 * n).try_for_each(|_| r.skip()),
        _ => Ok(()),
    }
}

/// A block hash as the engine sent it: an integer (vLLM's builtin hash; negative ones too),
/// bytes (sha256), or nil.
fn engine_hash(r: &mut Reader) -> Result<Option<EngineHash>, MsgpackError> {
    Ok(match r.value()? {
        Value::Nil => None,
        Value::Uint(u) => Some(u),
        Value::Int(i) => Some(i as u64),
        Value::Bin(b) => Some(fold(b)),
        v => return Err(r.error(format!("block hash: {v:?}"))),
    })
}

/// Folds a bytes hash to 64 bits (its own bits are already uniform: a digest).
fn fold(b: &[u8]) -> u64 {
    b.chunks(8).fold(0u64, |h, c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        h.rotate_left(17) ^ u64::from_le_bytes(w)
    })
}
