//! The simulated engine as the prefill (P) and decode (D) sides of a disaggregated pair, over
//! real sockets, with this test acting as the router. vLLM: P answers the fixture's P leg with
//! `kv_transfer_params` shaped like the real vLLM 0.32's, holds the blocks until D pulls them or
//! the lease runs out, and D fails as vLLM's default `kv_load_failure_policy = "fail"` does.
//! SGLang: P and D get the same request with bootstrap fields, P's rank follows the room.
//!
//! By part: [`vllm_transfer`], [`vllm_edges`] and [`sglang`], over [`helpers`].
#![cfg(feature = "sim")] // the simulated engine

#[path = "../common/mod.rs"]
mod common;
mod helpers;
mod sglang;
mod vllm_edges;
mod vllm_transfer;
