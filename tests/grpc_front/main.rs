//! rankgate's gRPC front door (`server.grpc_listen`) in front of simulated engines configured
//! with `grpc_url` only, over real sockets on 127.0.0.1, for both flavors where the behaviour is
//! per flavor. It proves that:
//!
//! - `Generate` goes to the least-KV rank, the rank set in the request message and every other
//!   byte kept (unknown fields too; a client's own rank is replaced), `x-rankgate-worker` naming
//!   the rank; SGLang's `Embed` is pinned the same way, vLLM's (no rank field) passes untouched;
//! - a client that leaves stops the engine's generation, and `Abort` reaches the engine holding
//!   the id and no other (an unknown id reaches none and is OK);
//! - no routable rank (engine dead, port refusing) is `UNAVAILABLE`; methods rankgate does not
//!   serve are `UNIMPLEMENTED`, naming the method;
//! - `GetLoads` and `grpc.health.v1` are answered from rankgate's own snapshot;
//! - in a fleet of an HTTP-only and a gRPC-only engine, each front door sends only to its own.
//!
//! Every wait polls observable state (`/workers`, the engine's records) within a bound.
//!
//! By part: [`routing`], [`abort`] and [`status`], over [`helpers`].

mod abort;
#[path = "../common/mod.rs"]
mod common;
mod helpers;
mod routing;
mod status;
