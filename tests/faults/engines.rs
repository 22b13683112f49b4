//! Engines on a bad day, over real sockets: killed under streaming load, hung, stalled mid-stream,
//! answering 503 while their `/metrics` look fine, failing `/health`, hanging `/v1/models`, a
//! fleet that fails everywhere (the retry budget), clients whose bodies break, admission, and
//! which failures count against a rank (transport: the whole engine; 4xx: never).
//!
//! Every wait is on observable state and bounded in time; timings worth quoting are printed
//! (`cargo test --test faults -- --nocapture`).
//!
//! By theme: [`deaths`] (killed, hung, stalled), [`ejection`] (what counts against a rank),
//! [`hung`] (gray failures: a rank whose requests never start, judged against its peers),
//! [`requests`] (broken client bodies, admission) and [`connections`] (the router's connections to
//! engines), over [`helpers`].

mod connections;
mod deaths;
mod ejection;
mod helpers;
mod hung;
mod requests;
