//! rankgate: a per-DP-rank load-aware front door for vLLM and SGLang inference fleets.
//!
//! Module map, and what each owns:
//! - [`config`]: the TOML config file, parsed then validated; errors name file, key and problem.
//!   It imports nothing of the crate; the engine types (`Engine`, `Flavor`, ...) are its own.
//! - [`worker`]: engines' expansion into virtual workers, the `RankId` identity, stable
//!   `EngineId`/`WorkerId`, and the fleet (`EngineEntry`, `Member`).
//! - [`table`]: the one snapshot (fleet, telemetry, catalog) behind one `ArcSwap`, and the
//!   per-worker live counters.
//! - [`membership`], [`control`], [`discovery`]: fleet changes per source (the file, the admin
//!   API, DNS and Kubernetes discovery), reload and the admin token.
//! - [`telemetry`]: one poller per engine (gRPC `GetLoads`, HTTP loads, Prometheus, in order of
//!   preference), health probes, and the single publisher; [`telemetry::prom`] and
//!   [`telemetry::loads`] project what engines report onto their ranks.
//! - [`wire`]: the load-report wire types and their JSON reader, shared by `table` and
//!   `telemetry` (a leaf, so `table` need not import `telemetry`).
//! - [`upstream`]: what reaches an engine: its connection state (slots, idle connections, h2
//!   streams) and the request body as it goes out; below both the fleet and the proxy.
//! - [`live`]: the per-worker counters that change with every request.
//! - [`ix`]: typed indices (`WorkerIx`, `EngineIx`) for the snapshot's per-worker and per-engine
//!   vectors.
//! - [`scan`]: one field of a JSON or multipart body, read without a parse.
//! - [`tracecontext`]: W3C `traceparent`, read and written.
//! - [`deadlines`]: every deadline of the request path, and who enforces it.
//! - [`catalog`]: the fleet's models and which engines serve each, with [`model_routes`]
//!   (`[[routes]]`: names rewritten to served models, by weight; a leaf); [`prefix`]: the prompt
//!   prefixes sent to each rank (affinity); [`prompt`]: a request's prompt as affinity
//!   compares it (chunk names, and token ids where the model's tokenizer is known); [`pbwire`]: protobuf edited at the wire level;
//!   [`tls`]: certificates for the listeners and engines; [`x509`]: a certificate's expiry
//!   read from its DER (a leaf); [`memory`]: giving freed heap back.
//! - [`tokenize`]: a request's prompt as the engine's token ids (the model's tokenizer and chat
//!   template run in-process, or the engine's `/tokenize`), for exact prefix-cache routing; a
//!   leaf.
//! - [`reason`]: why a rank is Unavailable, one variant per kind of cause.
//! - [`recheck`]: rounds of reading the engines' model lists again at once, asked by a request
//!   for a model no list names; [`adapter_loads`]: LoRA adapters `[[adapters]]` declares,
//!   loaded on a server when a request first names one; [`adapters`]: each rank's adapters in
//!   flight.
//! - [`policy`]: rank selection (`least_kv`, `round_robin`, `random`).
//! - [`outlier`]: consecutive failures per rank, ejection and trial re-admission.
//! - [`proxy`]: the OpenAI-compatible and gRPC front doors, stacks of tower layers, each layer
//!   given its own state when the stack is built (see docs/architecture.md).
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

pub mod adapter_loads;
pub mod adapters;
pub mod admin;
pub mod app;
pub mod catalog;
pub mod config;
pub mod control;
pub mod deadlines;
pub mod discovery;
pub mod first_byte;
pub mod http;
pub mod ix;
pub mod kv;
pub mod live;
pub mod logging;
pub mod membership;
pub mod memory;
pub mod metrics;
pub mod model_routes;
#[cfg(feature = "otlp")]
pub mod otlp;
pub mod outlier;
pub mod pbwire;
pub mod policy;
pub mod prefix;
pub mod prompt;
pub mod proto;
pub mod proxy;
pub mod reason;
pub mod recheck;
pub mod scan;
pub mod table;
pub mod telemetry;
pub mod tls;
pub mod tokenize;
pub mod tracecontext;
pub mod upstream;
pub mod wire;
pub mod worker;
pub mod x509;
