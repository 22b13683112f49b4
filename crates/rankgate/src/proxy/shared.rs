//! What every layer of one router shares ([`Shared`]), and each connection's own handle on it
//! ([`Ctx`]), with what is known of the connection: its core, peer and front door.

use std::net::SocketAddr;
use std::sync::Arc;

use http::header::HeaderValue;

use super::streams::{client_key, ClientStreams};
use crate::config::Cidr;
use crate::metrics::Metrics;
use crate::policy::Selector;
use crate::table::Table;

/// Which connections a stack serves: the OpenAI HTTP API or the engines' gRPC services.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Front {
    Http,
    Grpc,
}

/// What the layers of one router share: the table, the selector and the metrics. Everything
/// else a layer needs is its own, given to it when the stack is built (see `stack`).
pub struct Shared {
    pub table: Arc<Table>,
    pub selector: Arc<Selector>,
    pub metrics: Arc<Metrics>,
    /// Requests in flight per client address (`server.max_streams_per_client`).
    pub clients: ClientStreams,
    /// `server.trusted_proxies`: peers that carry many clients' requests.
    pub trusted: Box<[Cidr]>,
    /// `[[adapters]]` loaded on demand.
    pub loader: Arc<crate::adapter_loads::Loader>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Shared")
    }
}

/// A connection's own handle on [`Shared`], what the layers and guards that read it hold, with
/// what is known of the connection itself.
///
/// `read` and `retry` clone the layers below them for every request, and each guard in a
/// response body holds a reference: on one `Arc` shared by all connections, every one of those
/// reference counts would be a cache line bouncing between cores on every request. Each
/// connection gets its own handle (one allocation per connection), so these counts stay on the
/// core that runs the connection. (A layer's own state, one for the router, is cloned only by
/// the few layers that keep it in their futures: the retry policy, the error answers, the dial.)
#[derive(Clone)]
pub struct Ctx(Arc<Conn>);

pub struct Conn {
    shared: Arc<Shared>,
    /// The core it is served on (thread-per-core; else 0): whose idle engine connections its
    /// requests take (send).
    pub core: usize,
    /// The client's address.
    pub peer: SocketAddr,
    /// Its IP as a header value (X-Forwarded-For), rendered once for all of its requests.
    pub peer_ip: HeaderValue,
    /// The front door it came in through.
    pub front: Front,
    /// Its address's key in the per-client counts ([`ClientStreams`], engines' shares);
    /// `None` for a peer in `server.trusted_proxies`, which carries many clients' requests and
    /// is held to neither.
    pub client: Option<u32>,
}

impl Ctx {
    pub fn new(shared: &Arc<Shared>, peer: SocketAddr, front: Front) -> Ctx {
        Ctx::on(shared, 0, peer, front)
    }

    /// A connection served on `core`.
    pub fn on(shared: &Arc<Shared>, core: usize, peer: SocketAddr, front: Front) -> Ctx {
        Ctx(Arc::new(Conn {
            shared: shared.clone(),
            core,
            peer,
            peer_ip: peer_ip_header(peer),
            front,
            client: (!shared.trusted.iter().any(|c| c.contains(peer.ip())))
                .then(|| client_key(peer.ip())),
        }))
    }

    /// Whether it is the gRPC front door's.
    pub fn grpc(&self) -> bool {
        self.0.front == Front::Grpc
    }

    pub fn conn(&self) -> &Conn {
        &self.0
    }
}

impl std::ops::Deref for Ctx {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0.shared
    }
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ctx")
    }
}

/// The client's address as a header value, rendered once per connection. An IPv4 client of a
/// dual-stack listener shows as its IPv4 address, not `::ffff:a.b.c.d`.
pub fn peer_ip_header(peer: std::net::SocketAddr) -> HeaderValue {
    HeaderValue::from_str(&peer.ip().to_canonical().to_string())
        .unwrap_or(HeaderValue::from_static("unknown"))
}
