//! The simulated engine's HTTP surface over real sockets: served models, API keys, what it
//! records of each request, and every endpoint it imitates, answered by the rank it was pinned to.
//!
//! By part: [`serving`] (models, API keys, records), [`vllm`] and [`sglang`] (each flavor's
//! endpoints), [`queue`] (a vLLM rank's waiting queue), over [`helpers`].

#[path = "../common/mod.rs"]
mod common;
mod helpers;
mod queue;
mod serving;
mod sglang;
mod vllm;
