//! The front door's own headers and gates, over real sockets: client API keys, `x-request-id`,
//! `X-Forwarded-For` / `-Proto`, and CORS.
//!
//! By part: [`keys`], [`headers`] and [`cors`], over [`helpers`].
#![cfg(feature = "sim")] // the simulated engine

#[path = "../common/mod.rs"]
mod common;
mod cors;
mod headers;
mod helpers;
mod keys;
