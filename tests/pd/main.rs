//! Prefill/decode disaggregation through the router, over real sockets, against simulated
//! prefill and decode servers that speak vLLM's NIXL "pull" protocol and SGLang's bootstrap
//! one: each request goes to a prefill rank and a decode rank, each chosen by its own side's
//! load; the client gets the decode's answer; failures on either side are failed over or
//! counted, never a silent recompute.
//!
//! By part: [`legs`] (where each leg goes, and failover), [`failures`] (leases, errors and
//! explanations) and [`broken`] (fleets that fail every request, and failover of either leg), over
//! [`helpers`]; [`untrusted`]: a prefill's parameters checked before a decode sees them.
#![cfg(feature = "sim")] // the simulated engine

mod broken;
#[path = "../common/mod.rs"]
mod common;
mod failures;
mod helpers;
mod legs;
mod truth;
mod untrusted;
