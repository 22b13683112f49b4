//! What rankgate keeps to reach one engine: its origin and `Host` parsed once, the connection
//! slots that cap requests in flight to it (`server.max_engine_connections`), its idle HTTP/1
//! connections, and the h2 connections its gRPC calls are spread over.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use tokio::sync::Notify;

use super::idle::Idle;
pub use crate::config::ENGINE_SHARE_PER_CLIENT;

/// The connection slots to one engine. Taking and giving back a slot is one atomic operation
/// on the request path (two with the client's share); only a request that finds every slot
/// taken waits, and only then is anyone woken (tokio's `Semaphore` locks its waiter list on
/// every release, from every core).
///
/// One client address holds at most 1/[`ENGINE_SHARE_PER_CLIENT`] of the slots (at least one),
/// so one that fills the engine with streams it never reads leaves the rest to the others: its
/// requests past its share wait, as any request at the cap does, for one of its own to end. The
/// shares are counted in [`SHARE_BUCKETS`] counters by the client's key (a hash of its address):
/// addresses whose keys meet share one share.
#[derive(Debug)]
pub struct Slots {
    used: AtomicUsize,
    limit: usize,
    /// Slots held per bucket of client keys, and what one bucket may hold.
    shares: Box<[AtomicUsize]>,
    share: usize,
    /// Requests waiting for a slot, and their wake-up.
    waiting: AtomicUsize,
    /// Of them, those held back by their share: while there are any, a slot given back wakes
    /// every waiter (the one woken alone might be held back still, and the others sleep on).
    held_back: AtomicUsize,
    freed: Notify,
}

/// Buckets of client keys an engine's shares are counted in.
pub const SHARE_BUCKETS: usize = 64;

impl Slots {
    pub fn new(limit: usize) -> Slots {
        Slots {
            used: AtomicUsize::new(0),
            limit,
            shares: (0..SHARE_BUCKETS).map(|_| AtomicUsize::new(0)).collect(),
            share: (limit / ENGINE_SHARE_PER_CLIENT).max(1),
            waiting: AtomicUsize::new(0),
            held_back: AtomicUsize::new(0),
            freed: Notify::new(),
        }
    }

    fn bucket(&self, client: u32) -> &AtomicUsize {
        &self.shares[client as usize % SHARE_BUCKETS]
    }

    /// A slot for the client `client` (its key; `None`: a trusted proxy, held to no share),
    /// now: `Err(true)` when its share is what holds it back, `Err(false)` when every slot is
    /// taken.
    fn try_take_as(&self, client: Option<u32>) -> Result<(), bool> {
        let share = self.share;
        let bucket = client.map(|c| self.bucket(c));
        if let Some(b) = bucket {
            if (b.fetch_update(SeqCst, SeqCst, |n| (n < share).then_some(n + 1))).is_err() {
                return Err(true);
            }
        }
        let taken = self
            .used
            .fetch_update(SeqCst, SeqCst, |n| (n < self.limit).then_some(n + 1))
            .is_ok();
        if !taken {
            if let Some(b) = bucket {
                b.fetch_sub(1, SeqCst);
            }
            return Err(false);
        }
        Ok(())
    }

    pub(crate) fn try_take(&self, client: Option<u32>) -> bool {
        self.try_take_as(client).is_ok()
    }

    pub(crate) async fn take(&self, client: Option<u32>) {
        self.waiting.fetch_add(1, SeqCst);
        // Counted as waiting before looking, so a slot given back after the look wakes us.
        struct Waiting<'a>(&'a AtomicUsize, &'a AtomicUsize, bool);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, SeqCst);
                if self.2 {
                    self.1.fetch_sub(1, SeqCst);
                }
            }
        }
        let mut waiting = Waiting(&self.waiting, &self.held_back, false);
        loop {
            let freed = self.freed.notified();
            let mut freed = std::pin::pin!(freed);
            freed.as_mut().enable();
            match self.try_take_as(client) {
                Ok(()) => return,
                Err(true) if !waiting.2 => {
                    waiting.2 = true;
                    self.held_back.fetch_add(1, SeqCst);
                    // Counted before looking again, so a give-back after the look wakes all.
                    if self.try_take_as(client).is_ok() {
                        return;
                    }
                }
                Err(_) => {}
            }
            freed.await;
        }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Slots the client `client` holds now (with any whose keys share its bucket).
    #[cfg(test)]
    fn held_by(&self, client: u32) -> usize {
        self.bucket(client).load(SeqCst)
    }

    pub(crate) fn give_back(&self, client: Option<u32>) {
        if let Some(c) = client {
            self.bucket(c).fetch_sub(1, SeqCst);
        }
        self.used.fetch_sub(1, SeqCst);
        if self.waiting.load(SeqCst) > 0 {
            match self.held_back.load(SeqCst) {
                0 => self.freed.notify_one(),
                _ => self.freed.notify_waiters(),
            }
        }
    }
}

/// Most h2 connections rankgate opens to one engine's gRPC service.
pub const MAX_GRPC_CONNECTIONS: usize = 64;

/// How many connections rankgate opens to one engine (`server.max_engine_connections`), and
/// how many gRPC calls one h2 connection carries before the next opens.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub connections: usize,
    pub streams_per_connection: usize,
}

impl ConnLimits {
    pub fn of(server: &crate::config::ServerConfig) -> ConnLimits {
        ConnLimits {
            connections: server.max_engine_connections,
            streams_per_connection: server.grpc_streams_per_connection,
        }
    }
}

impl Default for ConnLimits {
    fn default() -> ConnLimits {
        ConnLimits {
            connections: crate::config::DEFAULT_MAX_ENGINE_CONNECTIONS,
            streams_per_connection: crate::config::DEFAULT_GRPC_STREAMS_PER_CONNECTION,
        }
    }
}

/// What rankgate needs to reach one engine: its authorities, parsed once, and the slots and
/// streams its requests take.
#[derive(Debug)]
pub struct EngineConn {
    /// `http` or `https`, as the engine's URLs say.
    pub scheme: http::uri::Scheme,
    /// The `Host` an HTTP/1 request to it carries, rendered once: the client would otherwise
    /// format it into a new string for every request.
    pub host: http::HeaderValue,
    /// `scheme://authority`, what a new connection is opened to.
    pub origin: http::Uri,
    pub grpc_authority: Option<http::uri::Authority>,
    pub slots: Slots,
    /// Its HTTP/1 connections between requests.
    pub idle: Idle,
    /// Its HTTP/1 connections open now, in use or idle.
    pub open: AtomicUsize,
    pub streams: Streams,
}

impl EngineConn {
    /// The way to the engine at `authority`, over TLS when `tls`; `grpc`: the authority of its
    /// gRPC service, if it has one.
    pub fn new(authority: &str, tls: bool, grpc: Option<&str>, limits: ConnLimits) -> EngineConn {
        let grpc_connections = match grpc {
            Some(_) => limits.connections.min(MAX_GRPC_CONNECTIONS),
            None => 0,
        };
        let scheme = match tls {
            true => http::uri::Scheme::HTTPS,
            false => http::uri::Scheme::HTTP,
        };
        EngineConn {
            host: host_header(authority, tls),
            // Validated at config load; a failure here would be a bug in validation.
            origin: http::Uri::try_from(format!("{scheme}://{authority}"))
                .unwrap_or(http::Uri::from_static("http://invalid.invalid:1")),
            scheme,
            grpc_authority: grpc.and_then(|a| http::uri::Authority::try_from(a).ok()),
            slots: Slots::new(limits.connections),
            idle: Idle::default(),
            open: AtomicUsize::new(0),
            streams: Streams::new(grpc_connections, limits.streams_per_connection),
        }
    }
}

/// `Host` for an HTTP/1 request to `authority`, as hyper's client writes it: the host, with the
/// port unless it is the scheme's default.
fn host_header(authority: &str, tls: bool) -> http::HeaderValue {
    let default = if tls { 443 } else { 80 };
    let shown = match http::uri::Authority::try_from(authority) {
        Ok(a) if a.port_u16() == Some(default) => a.host().to_string(),
        _ => authority.to_string(),
    };
    http::HeaderValue::try_from(shown).unwrap_or(http::HeaderValue::from_static("invalid.invalid"))
}

/// The h2 connections to one engine's gRPC service, by the calls each carries: a call goes on
/// the first connection under the stream limit, so one connection serves until the engine's
/// stream limit would make calls queue on it, and then the next one opens.
#[derive(Debug)]
pub struct Streams {
    active: Box<[AtomicUsize]>,
    limit: usize,
}

impl Streams {
    pub fn new(connections: usize, limit: usize) -> Streams {
        Streams {
            active: (0..connections).map(|_| AtomicUsize::new(0)).collect(),
            limit,
        }
    }

    /// The connection a new call takes. Every one at its limit: the least busy (the call
    /// queues there, in h2, for a stream).
    pub(crate) fn take(&self) -> usize {
        let under = |n: usize| (n < self.limit).then_some(n + 1);
        if let Some(k) = self
            .active
            .iter()
            .position(|a| a.fetch_update(SeqCst, SeqCst, under).is_ok())
        {
            return k;
        }
        let k = (0..self.active.len())
            .min_by_key(|&k| self.active[k].load(SeqCst))
            .unwrap_or(0);
        self.active[k].fetch_add(1, SeqCst);
        k
    }

    pub(crate) fn give_back(&self, k: usize) {
        self.active[k].fetch_sub(1, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    use std::time::Duration;

    use super::{host_header, Slots};

    #[test]
    fn the_host_header_is_the_engines_as_hyper_would_write_it() {
        assert_eq!(host_header("10.0.0.7:8000", false), "10.0.0.7:8000");
        assert_eq!(host_header("vllm:80", false), "vllm");
        assert_eq!(host_header("vllm:443", true), "vllm");
        assert_eq!(host_header("vllm:443", false), "vllm:443");
        assert_eq!(host_header("[::1]:8000", false), "[::1]:8000");
    }

    /// Whether `n` goes above 0 within 5 s: a waiter has counted itself.
    async fn counted(n: &AtomicUsize) -> bool {
        let above = async {
            while n.load(super::SeqCst) == 0 {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), above)
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_full_engine_makes_the_next_request_wait_until_a_slot_is_given_back() {
        let slots = Arc::new(Slots::new(2));
        let [a, b, c, d] = [0, 1, 2, 3].map(Some);
        assert!(slots.try_take(a) && slots.try_take(b));
        assert!(!slots.try_take(c), "at the cap");
        let waiter = {
            let slots = slots.clone();
            tokio::spawn(async move { slots.take(c).await })
        };
        // Still waiting: nothing was given back.
        assert!(counted(&slots.waiting).await, "the waiter counts itself");
        assert!(!waiter.is_finished());
        slots.give_back(a);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken by the slot given back")
            .unwrap();
        assert!(!slots.try_take(d), "the waiter holds the freed slot");
        assert_eq!(slots.waiting.load(super::SeqCst), 0);
        slots.give_back(b);
        slots.give_back(c);
        assert!(slots.try_take(a) && slots.try_take(b) && !slots.try_take(c));
    }

    #[tokio::test]
    async fn one_client_holds_at_most_half_the_slots_and_waits_for_its_own() {
        let slots = Arc::new(Slots::new(4));
        let (flood, other) = (Some(7), Some(8));
        assert!(slots.try_take(flood) && slots.try_take(flood));
        assert!(!slots.try_take(flood), "past its share, with slots free");
        assert_eq!(slots.held_by(7), 2);
        assert!(slots.try_take(other), "another client still finds a slot");
        let waiter = {
            let slots = slots.clone();
            tokio::spawn(async move { slots.take(flood).await })
        };
        assert!(
            counted(&slots.held_back).await,
            "the flood's next request waits, held back by its share"
        );
        // Another client's slot given back frees none of the flood's share: it still waits.
        slots.give_back(other);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        slots.give_back(flood);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken once one of its own ended")
            .unwrap();
        assert_eq!(slots.held_by(7), 2);
        assert_eq!(slots.held_back.load(super::SeqCst), 0);
        // A trusted proxy (no key) carries many clients: held to no share, only to the cap.
        slots.give_back(flood);
        slots.give_back(flood);
        assert!(
            (0..4).all(|_| slots.try_take(None)),
            "all four, past any share"
        );
        assert!(!slots.try_take(None), "at the cap");
    }
}
