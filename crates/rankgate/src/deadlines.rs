//! Every deadline a request meets on its way through rankgate, in one place, read once from
//! `[server]` and handed to whoever enforces it:
//!
//! ```text
//! deadline      key (default)                       enforced by         on expiry
//! header_read   server.header_read_timeout (10 s)   http::serve, watch  connection closed
//! idle          server.idle_timeout (60 s)          http::watch         connection closed
//! send          server.send_timeout (60 s)          http::conn, watch   connection cut, its
//!                                                                       engine requests with it
//! h2_keepalive  server.h2_keepalive_interval (20 s) hyper's h2 server   connection closed
//! body_read     server.body_read_timeout (30 s)     proxy read, pick,   408 (gRPC:
//!                                                   grpc local,         DEADLINE_EXCEEDED)
//!                                                   upstream request
//! body          server.body_timeout (60 s)          the same            408 (gRPC:
//!                                                                       DEADLINE_EXCEEDED)
//! connect       server.connect_timeout (2 s)        http::dial (every   502, retryable,
//!                                                   client's connector) counted against the
//!                                                                       engine
//! response      server.response_timeout (30 min)    proxy send, grpc    504 (all engine
//!                                                   local               connections busy: 503)
//! stream_idle   server.stream_idle_timeout (5 min)  proxy body          stream cut (SSE: an
//!                                                                       error event)
//! ```
//!
//! `connect` is one deadline for the whole establishment of a connection, counted from the start
//! of the TCP connect: the connect, the TLS handshake of an `https://` engine, and for h2 (gRPC)
//! connections the engine's first bytes (its SETTINGS; an h2 client may send before them, so a
//! silent server would otherwise hang every call on the connection). An HTTP/1 handshake
//! exchanges nothing: the engine speaks only to answer, under `response`.
//!
//! Two more are not per request: an engine's idle kept-alive connection is closed after
//! [`crate::upstream::idle::IDLE_FOR`], and `server.drain_grace` bounds the drain at shutdown
//! (`app::Router::shutdown`): when it ends, the engine connections are cut
//! ([`crate::upstream::Cutoff`]) so every stream still running ends with its error event or
//! status, and the front door (http::serve) closes what is left [`crate::app::CUT_FLUSH`] later.

use std::time::Duration;

use crate::config::ServerConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// A connection's first request head, counted from its opening (TLS handshake and h2
    /// preface included); later heads fall under `idle`.
    pub header_read: Duration,
    /// A client connection with no request in flight.
    pub idle: Duration,
    /// A client connection whose answer could not be written to it (the client takes nothing
    /// of it): cut, and the engine requests it carries are dropped with it.
    pub send: Duration,
    /// Between h2 keep-alive pings to a client (its answer is due within the same time).
    pub h2_keepalive: Duration,
    /// Any wait for more of a client's request body.
    pub body_read: Duration,
    /// The whole of a client's request body, however steadily it comes: counted from the
    /// first wait for it (a body already there when its head is read costs no clock read).
    pub body: Duration,
    /// A new connection to an engine established: TCP connect, TLS handshake, and an h2
    /// engine's first frame, one deadline from the start of the connect.
    pub connect: Duration,
    /// From sending a request to an engine to its response headers (connection slot wait
    /// included).
    pub response: Duration,
    /// Any gap between two pieces of an engine's response body.
    pub stream_idle: Duration,
}

impl Deadlines {
    pub fn of(server: &ServerConfig) -> Deadlines {
        Deadlines {
            header_read: server.header_read_timeout,
            idle: server.idle_timeout,
            send: server.send_timeout,
            h2_keepalive: server.h2_keepalive_interval,
            body_read: server.body_read_timeout,
            body: server.body_timeout,
            connect: server.connect_timeout,
            response: server.response_timeout,
            stream_idle: server.stream_idle_timeout,
        }
    }
}
