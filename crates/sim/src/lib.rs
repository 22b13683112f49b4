//! rankgate's simulator and the tools built on it, kept out of the router crate (`rankgate`) so
//! the production build carries none of them (no hdrhistogram, no simulated engine):
//! - [`sim`]: the simulated engine used by tests, the demo and benchmarks (`rankgate
//!   mock-engine`).
//! - [`load`]: the load client (`rankgate load`, scenarios, the demo).
//! - [`scenario`]: routing-quality scenarios: a simulated fleet, a workload, events, per policy.
//! - [`demo`]: the self-contained demo behind `rankgate demo`.
//! - [`tools`]: the client tools' command lines (`rankgate load`, `openai-client`,
//!   `grpc-client`).
//!
//! They use the router only through its public API, as any other client of the library would.

pub mod demo;
pub mod load;
pub mod scenario;
pub mod sim;
pub mod tools;
