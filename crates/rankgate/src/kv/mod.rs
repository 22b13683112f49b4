//! Exact prefix-cache routing's view of the engines: the KV-cache events each rank publishes
//! (vLLM's and SGLang's `--kv-events-config`), followed into a per-rank index of the blocks it
//! holds, named by rankgate's own hash of their token ids.
//!
//! - [`capture`]: a recorded capture's messages, replayed by tests, benches and the simulator;
//! - [`hash`]: the block names (one function for the engines' blocks and the prompts');
//! - [`msgpack`]: a bounded reader of the payloads; [`event`]: one message decoded;
//! - [`index`]: a rank's index: read by picks without a lock, written by one task;
//! - [`state`]: what an index says of itself (available, unavailable and why, off and why),
//!   [`status`]: as `/workers` shows it;
//! - [`feed`]: where each rank's events come from, and the tasks that read them;
//! - [`listen`]: the endpoints rankgate binds for engines that connect, and whom they trust;
//! - [`replay`]: the engine's replay socket, asked for what a gap lost;
//! - [`zmtp`]: ZeroMQ's wire protocol, as much as a SUB (and the simulator's PUB) needs.

pub mod capture;
pub mod event;
pub mod feed;
pub mod hash;
pub mod index;
pub mod listen;
pub mod msgpack;
pub mod replay;
pub mod state;
pub mod status;
pub mod writer;
pub mod zmtp;

pub use event::{decode, DecodeError, Event, Message};
pub use hash::block_hashes;
pub use index::RankIndex;
pub use state::KvState;
pub use writer::Writer;

#[cfg(test)]
mod tests;
