//! The integration tests' helpers: crates/testkit (built once for every target), and here what
//! only a target of the binary's own package can have: the `rankgate` binary's path
//! (`CARGO_BIN_EXE_rankgate`), in [`binary`].
#![allow(dead_code)]

pub use rankgate_testkit::*;

pub mod binary;
