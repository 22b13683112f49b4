//! The limits a listener serves its client connections under ([`ServeOptions`]), and what the
//! listeners of one front door share ([`Door`]). Plain data read by the accept loop, the
//! connection plumbing and the connection watch alike.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use super::admission::Admission;
use super::throttle::Throttle;
use crate::config::{ServerConfig, DEFAULT_CLIENT_IPV6_PREFIX, DEFAULT_CLIENT_SHARE};
use crate::deadlines::Deadlines;
use crate::tls::ServerTls;

/// File descriptors kept back from client connections for listeners, telemetry and logs.
const RESERVED_FDS: usize = 64;

/// The admin listener's per-address share of its 256 places: 16 each, so it takes 16
/// addresses, every connection of each busy with a request, to fill it (eight, the issue's
/// flood, hold half). Kubernetes probes and a Prometheus scraper need a few connections each.
pub const ADMIN_CLIENT_SHARE: usize = 16;

/// Limits on one listener's client connections.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    /// A connection whose answer could not be written for this long is cut (its client takes
    /// nothing of it): see [`super::watch`].
    pub send_timeout: Duration,
    pub h2_keepalive: Duration,
    pub max_header_bytes: usize,
    pub max_connections: usize,
    /// Connections one client address may hold at once (see [`super::admission`]).
    pub max_connections_per_client: usize,
    /// The prefix an IPv6 client is counted by (`server.client_ipv6_prefix`).
    pub client_ipv6_prefix: u8,
    pub drain_grace: Duration,
    /// Shared by several listeners of one front door (thread-per-core); `None`: the listener's
    /// own.
    pub door: Option<Arc<Door>>,
    /// TLS on this listener; `None`: cleartext (HTTP/1.1 and h2c).
    pub tls: Option<Arc<ServerTls>>,
}

/// What the listeners of one front door share: the cap on client connections, the client
/// addresses' counts, and the throttled log lines of a full door and of failing accepts, so
/// all hold for the process as they would for a single listener.
#[derive(Debug)]
pub struct Door {
    pub(super) max_connections: usize,
    pub(super) slots: Arc<Semaphore>,
    pub(super) admission: Arc<Admission>,
    /// Throttled: an address at its limit refuses a connection for every one its flood opens.
    pub(super) client_full: Throttle,
    pub(super) accept_errors: Throttle,
    // Throttled too: at the cap with clients coming and going, every freed slot is one accept
    // and then the cap again, and a line each time was a flood.
    pub(super) cap_reached: Throttle,
}

impl Door {
    /// The door of listeners serving under `opts`.
    pub fn new(opts: &ServeOptions) -> Door {
        let max_connections = opts.max_connections;
        Door {
            max_connections,
            slots: Arc::new(Semaphore::new(max_connections)),
            admission: Arc::new(Admission::new(
                max_connections,
                opts.max_connections_per_client,
                opts.client_ipv6_prefix,
            )),
            client_full: Throttle::new(Duration::from_secs(5)),
            accept_errors: Throttle::new(Duration::from_secs(5)),
            cap_reached: Throttle::new(Duration::from_secs(5)),
        }
    }

    /// What `/metrics` shows of the door, read at scrape time.
    pub fn stats(&self) -> DoorStats {
        DoorStats {
            max_connections: self.max_connections,
            max_connections_per_client: self.admission.per_client,
            open: self.max_connections - self.slots.available_permits().min(self.max_connections),
            clients: self.admission.clients(),
            refused: self
                .admission
                .refused
                .load(std::sync::atomic::Ordering::Relaxed),
            replaced: self
                .admission
                .replaced
                .load(std::sync::atomic::Ordering::Relaxed),
            reclaimed: self
                .admission
                .reclaimed
                .load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Client connections open now.
    pub fn open(&self) -> usize {
        self.max_connections - self.slots.available_permits().min(self.max_connections)
    }
}

/// A door's limits and counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DoorStats {
    pub max_connections: usize,
    pub max_connections_per_client: usize,
    /// Connections open now.
    pub open: usize,
    /// Client addresses holding connections now.
    pub clients: usize,
    /// Connections closed waiting for a place: their address held its limit, all serving.
    pub refused: u64,
    /// Connections closed before their first request to make room for a newer one.
    pub replaced: u64,
    /// Connections idle between requests closed (gracefully) to make room for a newer one.
    pub reclaimed: u64,
}

impl Default for ServeOptions {
    /// For listeners that only trusted peers use (admin, the simulated engine).
    fn default() -> Self {
        ServeOptions {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            send_timeout: crate::config::DEFAULT_SEND_TIMEOUT,
            h2_keepalive: Duration::from_secs(20),
            max_header_bytes: 64 * 1024,
            max_connections: 256,
            // The simulated engine's one client is rankgate, from one address.
            max_connections_per_client: 256,
            client_ipv6_prefix: DEFAULT_CLIENT_IPV6_PREFIX,
            drain_grace: Duration::from_secs(30),
            door: None,
            tls: None,
        }
    }
}

impl ServeOptions {
    /// The admin listener's: the defaults, with a client address's share of them
    /// ([`ADMIN_CLIENT_SHARE`]), so that floods from fewer than that many addresses leave room
    /// for the probes and scrapes from others even when every one of their connections is
    /// busy. Idle ones are reclaimed besides ([`super::admission`]).
    pub fn admin() -> ServeOptions {
        let d = ServeOptions::default();
        ServeOptions {
            max_connections_per_client: d.max_connections / ADMIN_CLIENT_SHARE,
            ..d
        }
    }

    /// The front door's limits, from `[server]`.
    pub fn front_door(cfg: &ServerConfig) -> ServeOptions {
        let deadlines = Deadlines::of(cfg);
        let max_connections = cfg.max_connections.unwrap_or_else(default_max_connections);
        ServeOptions {
            header_read_timeout: deadlines.header_read,
            idle_timeout: deadlines.idle,
            send_timeout: deadlines.send,
            h2_keepalive: deadlines.h2_keepalive,
            max_header_bytes: cfg.max_header_bytes,
            max_connections,
            max_connections_per_client: (cfg.max_connections_per_client)
                .unwrap_or_else(|| default_per_client(max_connections)),
            client_ipv6_prefix: cfg.client_ipv6_prefix,
            drain_grace: cfg.drain_grace,
            door: None,
            tls: None,
        }
    }
}

/// Half the file descriptors this process may open, less a reserve: each client connection may
/// need one upstream connection too, and the admin listener must still find one to accept with.
pub fn default_max_connections() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into the struct it is given.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX)
    } else {
        1024
    };
    (soft.saturating_sub(RESERVED_FDS) / 2).clamp(16, 1 << 20)
}

/// A client address's share of `max_connections` unless the config says: an eighth, and at
/// least 16 (or the whole table when it is smaller).
pub fn default_per_client(max_connections: usize) -> usize {
    (max_connections / DEFAULT_CLIENT_SHARE)
        .max(16)
        .min(max_connections)
}
