//! How requests reach the engines, one [`Dial`] for the router: the connector new HTTP/1
//! connections are opened with, the h2 clients of the engines' gRPC services, and the
//! deadlines and size cap of an exchange ([`super::send`] uses it for each request).

use std::time::Duration;

use super::exposure::Exposure;
use crate::deadlines::Deadlines;
use crate::tls::Upstream;
use crate::upstream::{Cutoff, RequestBody};

/// How requests reach the engines, one for the router: the connector new HTTP/1 connections
/// are opened with (each engine's slots and idle connections are in its fleet entry), the h2
/// clients for their gRPC services, and the deadlines and size cap of an exchange.
pub struct Dial {
    pub(super) connector: crate::http::Connector,
    /// Client `k` holds each engine's `k`th h2 connection, opened once the connections before
    /// it carry their share of calls.
    pub grpc_clients: Vec<GrpcClient>,
    /// Every engine connection's reads, failed at once when a shutdown cuts what is still
    /// streaming (so each cut stream ends with its error event or status).
    pub cutoff: Cutoff,
    /// `server.response_timeout`.
    pub response: Duration,
    /// `server.stream_idle_timeout`.
    pub(super) stream_idle: Duration,
    /// `server.max_body_bytes` (a client body that outgrows it while streaming).
    pub(super) max_body: usize,
    /// `server.expose_worker`: whether the answer names its worker, and how.
    pub(super) exposure: Exposure,
    /// `routing.eject_after` and `routing.eject_for`: a request that hangs is a failure of its
    /// rank, judged in `send` (`hung.rs`).
    pub(super) ejection: crate::outlier::Policy,
}

/// A client for engines' gRPC services, over connections a shutdown can cut.
pub type GrpcClient = hyper_util::client::legacy::Client<
    crate::upstream::CutConnector<crate::http::Connector>,
    RequestBody,
>;

impl std::fmt::Debug for Dial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Dial")
    }
}

impl Dial {
    pub fn new(
        max_engine_connections: usize,
        max_body: usize,
        deadlines: Deadlines,
        upstream: &Upstream,
        exposure: Exposure,
        ejection: crate::outlier::Policy,
    ) -> Dial {
        let h2 = max_engine_connections.min(crate::upstream::MAX_GRPC_CONNECTIONS);
        let cutoff = Cutoff::default();
        Dial {
            connector: crate::http::connector(deadlines.connect, upstream, false),
            grpc_clients: (0..h2)
                .map(|_| {
                    let connector = crate::http::connector(deadlines.connect, upstream, true);
                    crate::http::h2_client_over(cutoff.connector(connector))
                })
                .collect(),
            cutoff,
            response: deadlines.response,
            stream_idle: deadlines.stream_idle,
            max_body,
            exposure,
            ejection,
        }
    }
}
