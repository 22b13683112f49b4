//! The limits a listener serves its client connections under ([`ServeOptions`]), and what the
//! listeners of one front door share ([`Door`]). Plain data read by the accept loop, the
//! connection plumbing and the connection watch alike.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use super::throttle::Throttle;
use crate::config::ServerConfig;
use crate::deadlines::Deadlines;
use crate::tls::ServerTls;

/// File descriptors kept back from client connections for listeners, telemetry and logs.
const RESERVED_FDS: usize = 64;

/// Limits on one listener's client connections.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub h2_keepalive: Duration,
    pub max_header_bytes: usize,
    pub max_connections: usize,
    pub drain_grace: Duration,
    /// Shared by several listeners of one front door (thread-per-core); `None`: the listener's
    /// own.
    pub door: Option<Arc<Door>>,
    /// TLS on this listener; `None`: cleartext (HTTP/1.1 and h2c).
    pub tls: Option<Arc<ServerTls>>,
}

/// What the listeners of one front door share: the cap on client connections, and the
/// throttled log lines of a full door and of failing accepts, so both hold for the process as
/// they would for a single listener.
#[derive(Debug)]
pub struct Door {
    pub(super) max_connections: usize,
    pub(super) slots: Arc<Semaphore>,
    pub(super) accept_errors: Throttle,
    // Throttled too: at the cap with clients coming and going, every freed slot is one accept
    // and then the cap again, and a line each time was a flood.
    pub(super) cap_reached: Throttle,
}

impl Door {
    pub fn new(max_connections: usize) -> Door {
        Door {
            max_connections,
            slots: Arc::new(Semaphore::new(max_connections)),
            accept_errors: Throttle::new(Duration::from_secs(5)),
            cap_reached: Throttle::new(Duration::from_secs(5)),
        }
    }
}

impl Default for ServeOptions {
    /// For listeners that only trusted peers use (admin, the simulated engine).
    fn default() -> Self {
        ServeOptions {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            h2_keepalive: Duration::from_secs(20),
            max_header_bytes: 64 * 1024,
            max_connections: 256,
            drain_grace: Duration::from_secs(30),
            door: None,
            tls: None,
        }
    }
}

impl ServeOptions {
    /// The front door's limits, from `[server]`.
    pub fn front_door(cfg: &ServerConfig) -> ServeOptions {
        let deadlines = Deadlines::of(cfg);
        ServeOptions {
            header_read_timeout: deadlines.header_read,
            idle_timeout: deadlines.idle,
            h2_keepalive: deadlines.h2_keepalive,
            max_header_bytes: cfg.max_header_bytes,
            max_connections: cfg.max_connections.unwrap_or_else(default_max_connections),
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
