//! rankgate's gRPC front door on the fleet's bad days, over real sockets on 127.0.0.1, for both
//! flavors where it is cheap. It proves that:
//!
//! - an engine killed mid-stream ends the client's stream with a gRPC status, UNAVAILABLE naming
//!   the worker (never a bare transport error), nothing stays in flight, and the next call goes
//!   to the other engine; a port that refuses connections is retried on the other engine;
//! - an engine that takes a call and never answers gets DEADLINE_EXCEEDED after
//!   `server.response_timeout`, and one that goes quiet mid-stream DEADLINE_EXCEEDED in the
//!   trailers after `server.stream_idle_timeout`, after the chunks it did send; either way the
//!   engine's stream is cancelled;
//! - bad input (not protobuf, compressed, two messages, a cut frame, no frame, too large, not
//!   gRPC at all, no method, an unknown service) gets a clear status, never reaches an engine,
//!   and the next good call is served;
//! - `server.max_in_flight` and client API keys hold on the gRPC front door;
//! - a shutdown lets a stream in flight finish and refuses new connections;
//! - an engine that answers every call UNAVAILABLE is ejected like one answering 503 over HTTP;
//!   a request that is not gRPC gets HTTP 415 (as the gRPC spec asks), a gRPC call over
//!   HTTP/1.1 (whose status could never reach the client) is refused before any engine, and an
//!   Abort that is not protobuf is INVALID_ARGUMENT. These four fail today: see each test.
//!
//! The simulated engine's gRPC side has no knob for a hung or a stalling call (`hang_requests`,
//! `stall_after_tokens` and `set_fail` act on its HTTP side only), so those engines are
//! [`FaultyEngine`](helpers::FaultyEngine)s here: a bare h2c server whose telemetry comes from a
//! simulated engine with the same ranks (`telemetry = ["grpc://..."]`). Every wait is bounded.
//!
//! By theme: [`deaths`] (killed engines, refused ports, ejection), [`hangs`] (hung and stalled
//! engines), [`bad_input`] and [`guards`] (admission, API keys, shutdown), over [`helpers`].

mod bad_input;
#[path = "../common/mod.rs"]
mod common;
mod deaths;
mod guards;
mod hangs;
mod helpers;
