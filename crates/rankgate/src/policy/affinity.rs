//! Prefix affinity (`routing.prefix_affinity`): among the ranks load allows, the one holding
//! the longest leading run of the prompt, in tokens. A rank whose engine publishes KV events
//! (`routing.kv_events`) and whose index is available is asked exactly: the prompt's blocks,
//! named as its index names them, that it holds. Any other rank is judged by rankgate's record
//! of the prompt chunks it sent there ([`crate::prefix`]), at its guess of tokens per chunk.

use crate::ix::WorkerIx;
use crate::prefix::TOKENS_PER_CHUNK;
use crate::prompt::Prompt;
use crate::worker::{Fleet, Member};

/// How much of a prompt a rank holds, and by whose account.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Held {
    /// Leading prompt tokens it holds (the prefill a hit there saves).
    pub tokens: u64,
    /// From its engine's own KV events; else from rankgate's record.
    pub exact: bool,
}

/// A prompt, asked of ranks: its block names are worked out once per block size.
pub struct Holdings<'a> {
    prompt: &'a Prompt,
    names: Vec<(u32, Vec<u64>)>,
}

impl<'a> Holdings<'a> {
    pub fn new(prompt: &'a Prompt) -> Holdings<'a> {
        Holdings {
            prompt,
            names: Vec::new(),
        }
    }

    pub fn prompt(&self) -> &Prompt {
        self.prompt
    }

    /// The prompt has nothing to match.
    pub fn is_empty(&self) -> bool {
        self.prompt.is_empty()
    }

    /// What `member` holds of the prompt.
    pub fn of(&mut self, member: &Member) -> Held {
        if let (Some(tokens), Some(bs)) = (&self.prompt.tokens, member.kv.block_size()) {
            let names = match self.names.iter().position(|(b, _)| *b == bs) {
                Some(i) => &self.names[i].1,
                None => {
                    self.names
                        .push((bs, crate::kv::block_hashes(tokens, bs as usize)));
                    &self.names[self.names.len() - 1].1
                }
            };
            let blocks = member.kv.matched_blocks(names) as u64;
            return Held {
                tokens: blocks * u64::from(bs),
                exact: true,
            };
        }
        Held {
            tokens: member.prefixes.matched(&self.prompt.chunks) as u64 * TOKENS_PER_CHUNK,
            exact: false,
        }
    }
}

/// Among `scores` at most `limit` and below `max_kv`, the rank holding the most of `prompt`
/// (the lower score between equal holdings), and what it holds; `None` when none holds any.
pub(super) fn longest_prefix(
    fleet: &Fleet,
    scores: &[(WorkerIx, f64)],
    prompt: &mut Holdings,
    limit: f64,
    max_kv: f64,
) -> Option<(WorkerIx, Held)> {
    let mut best: Option<(WorkerIx, Held, f64)> = None;
    for &(w, s) in scores {
        if s > limit || s >= max_kv {
            continue;
        }
        let held = prompt.of(&fleet.workers[w]);
        let better = match best {
            None => held.tokens > 0,
            Some((_, h, bs)) => held.tokens > h.tokens || (held.tokens == h.tokens && s < bs),
        };
        if better {
            best = Some((w, held, s));
        }
    }
    best.map(|(w, held, _)| (w, held))
}
