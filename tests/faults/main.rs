//! The fleet's bad days, over real sockets: engines that die, hang, stall or answer 5xx
//! ([`engines`]), clients that stall, flood or send garbage ([`clients`]), and a rollout's
//! SIGTERM ([`shutdown`]).
#![cfg(feature = "sim")] // the simulated engine

#[path = "../common/mod.rs"]
mod common;

mod clients;
mod engines;
mod shutdown;
