//! rankgate: a per-DP-rank load-aware front door for vLLM and SGLang inference fleets.
//!
//! Module map, and what each owns:
//! - [`config`]: the TOML config file, parsed then validated; errors name file, key and problem.
//! - [`worker`]: engines, their expansion into virtual workers, the `RankId` identity, stable
//!   `EngineId`/`WorkerId`, and the fleet (`EngineEntry`, `Member`).
//! - [`table`]: the one snapshot (fleet, telemetry, catalog) behind one `ArcSwap`, and the
//!   per-worker live counters.
//! - [`membership`], [`control`], [`discovery`]: fleet changes per source (the file, the admin
//!   API, DNS and Kubernetes discovery), reload and the admin token.
//! - [`telemetry`]: one poller per engine (gRPC `GetLoads`, HTTP loads, Prometheus, in order of
//!   preference), health probes, and the single publisher; [`telemetry::prom`] and
//!   [`telemetry::loads`] project what engines report onto their ranks.
//! - [`wire`]: the load-report wire types and their JSON reader, shared by `table` and
//!   `telemetry` (a leaf, so neither imports the other).
//! - [`reason`]: why a rank is Unavailable, one variant per kind of cause.
//! - [`policy`]: rank selection (`least_kv`, `round_robin`, `random`).
//! - [`outlier`]: consecutive failures per rank, ejection and trial re-admission.
//! - [`proxy`]: the OpenAI-compatible front door, a stack of tower layers: route, admit, read,
//!   retry, pick + pin, observe, send (with its timeouts).
//! - [`proto`]: code generated from `proto/` (gRPC load services, health).
//! - [`admin`]: `/health`, `/ready`, `/workers`, `/engines`, `/loads`, `/metrics`, and the
//!   admin API's changes.
//! - [`metrics`]: rankgate's own metrics on prometheus-client: request counters and histograms
//!   recorded in atomics, per-rank and per-engine series read from the snapshot at scrape time.
//! - [`http`]: accept loop, upstream clients, error bodies.
//! - [`logging`]: text or JSON log lines, the `RUST_LOG` filter with library internals quiet.
//! - `otlp` (feature `otlp`): the request spans exported over OTLP/HTTP.
//! - [`app`]: starts and stops the whole router.
//!
//! Not here: the simulator, the load client, the scenarios and the demo are the `rankgate-sim`
//! crate (crates/sim), and `rankgate top` is the `rankgate-top` crate (crates/top). They use this
//! library as any client would; the `rankgate` binary (src/main.rs, the root package) joins them.
//! The production build leaves them out (`cargo build --release --no-default-features`).

pub mod admin;
pub mod app;
pub mod catalog;
pub mod config;
pub mod control;
pub mod discovery;
pub mod http;
pub mod logging;
pub mod membership;
pub mod memory;
pub mod metrics;
#[cfg(feature = "otlp")]
pub mod otlp;
pub mod outlier;
pub mod pbwire;
pub mod policy;
pub mod prefix;
pub mod proto;
pub mod proxy;
pub mod reason;
pub mod table;
pub mod telemetry;
pub mod tls;
pub mod wire;
pub mod worker;
