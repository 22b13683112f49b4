//! The endpoints rankgate binds for engines that connect to publish their KV events
//! (`tcp://IP:PORT` in the engine's `--kv-events-config`), and whom they trust.
//!
//! Expected to connect: the engines whose ranks were registered here, from the addresses their
//! URLs resolve to (or `engines[].kv_events_from`), one connection per rank and topic. ZeroMQ's
//! NULL mechanism authenticates nobody, so the peer's address is the credential, checked at
//! accept: anyone else is closed before a byte is read, counted
//! ([`Refusals`], `rankgate_kv_publishers_refused_total` on `/metrics`) and logged at most once
//! per [`LOG_EVERY`]. A trusted peer's messages reach only the ranks of the engines that trust
//! its address.
//!
//! Limits, each a bound on what one peer costs:
//! - [`MAX_PUBLISHERS`] connections at once per endpoint;
//! - a message at most [`MAX_PAYLOAD`] (plus its topic and sequence), refused from its frame
//!   header, its buffer grown as bytes arrive ([`super::zmtp`]);
//! - a message finished within [`MESSAGE_DEADLINE`] of its first byte;
//! - one publisher per rank and topic: a rank's events come from the connection that claimed it
//!   with its first message. A second connection that speaks for a claimed rank waits at most
//!   [`CLAIM_WAIT`] for the first to go (an engine restarting reconnects while its old
//!   connection is being closed), then is refused and closed; the first keeps the rank: which
//!   of two is the engine cannot be told, and the first has the sequence the index follows.
//!   Unless the first has sent nothing for [`STALE_CLAIM`]: then it is closed and the second
//!   takes the rank. Both come from the engine's address, and a connection whose host
//!   vanished without closing it (a crash, a reboot) never errors on its own, since rankgate
//!   only reads from it: without this, the engine's next connection would be refused for good.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::{timeout, Instant};

use super::event::{decode, MAX_PAYLOAD};
use super::feed::{describe, lock, SharedWriter, MESSAGE_DEADLINE};
use super::writer::Writer;
use super::zmtp::{Subscriber, ZmtpError};
use crate::http::Throttle;

/// Publishers one bound endpoint takes at once. Each engine rank publishing here is one (each
/// DP rank has its own port, so usually one or a few engines' worth); more is a flood, and at
/// most this many messages of [`MAX_PAYLOAD`] are ever in progress on one endpoint.
pub const MAX_PUBLISHERS: usize = 64;
/// How long a second connection for a claimed rank waits for the first to go.
pub const CLAIM_WAIT: Duration = Duration::from_secs(2);
/// A rank's publisher silent this long gives the rank up to a second connection that claims
/// it (an engine restarting takes longer than this to load its model).
pub const STALE_CLAIM: Duration = Duration::from_secs(30);
/// At most one log line per endpoint this often about refused publishers (each is counted).
pub const LOG_EVERY: Duration = Duration::from_secs(10);

/// Publishers refused on rankgate's bound endpoints, by why; read by `/metrics`.
#[derive(Debug, Default)]
pub struct Refusals {
    /// Connected from an address that no engine publishing on the endpoint has.
    pub stranger: AtomicU64,
    /// Connected while [`MAX_PUBLISHERS`] were.
    pub full: AtomicU64,
    /// Spoke for a rank and topic whose publisher was still connected.
    pub duplicate: AtomicU64,
    /// Sent a message over [`MAX_PAYLOAD`], or more frames than a message has.
    pub oversized: AtomicU64,
    /// Did not finish a message within [`MESSAGE_DEADLINE`].
    pub slow: AtomicU64,
}

/// rankgate's bound endpoints, shared by every engine whose ranks connect to it.
#[derive(Default)]
pub struct Listeners {
    bound: Mutex<HashMap<SocketAddr, Arc<Bound>>>,
    refused: Arc<Refusals>,
}

/// A rank's messages on a bound endpoint: its topic and DP rank.
type RouteKey = (Vec<u8>, u32);

/// One rank publishing on a bound endpoint.
struct Route {
    writer: Weak<Mutex<Writer>>,
    /// The addresses its engine publishes from.
    from: Arc<[IpAddr]>,
    claim: Arc<Claim>,
}

/// Which connection publishes a rank's events.
struct Claim {
    /// One permit, held by that connection.
    permit: Arc<Semaphore>,
    /// When it last applied a message, and how to make it go.
    holder: Mutex<Option<(Instant, Arc<Notify>)>>,
}

impl Claim {
    fn new() -> Arc<Claim> {
        Arc::new(Claim {
            permit: Arc::new(Semaphore::new(1)),
            holder: Mutex::default(),
        })
    }

    fn holder(&self) -> std::sync::MutexGuard<'_, Option<(Instant, Arc<Notify>)>> {
        self.holder.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the rank for the connection signalled by `kick`: at once when free, else after
    /// the holder goes within [`CLAIM_WAIT`], or after closing a holder silent for
    /// [`STALE_CLAIM`]. `None`: refused.
    async fn take(&self, kick: &Arc<Notify>) -> Option<OwnedSemaphorePermit> {
        let permit = match timeout(CLAIM_WAIT, self.permit.clone().acquire_owned()).await {
            Ok(Ok(p)) => p,
            _ => {
                let stale = (self.holder().as_ref())
                    .filter(|(last, _)| last.elapsed() >= STALE_CLAIM)
                    .map(|(_, k)| k.clone());
                stale?.notify_one();
                timeout(CLAIM_WAIT, self.permit.clone().acquire_owned())
                    .await
                    .ok()?
                    .ok()?
            }
        };
        *self.holder() = Some((Instant::now(), kick.clone()));
        Some(permit)
    }

    /// Its holder applied a message now.
    fn heard(&self) {
        if let Some((last, _)) = self.holder().as_mut() {
            *last = Instant::now();
        }
    }
}

/// One bound endpoint: the ranks that publish to it, by topic and DP rank.
struct Bound {
    addr: SocketAddr,
    routes: Mutex<HashMap<RouteKey, Route>>,
    refused: Arc<Refusals>,
    log: Throttle,
}

/// A rank's place on a bound endpoint; dropping it (the engine left) takes the rank off.
pub struct Registration {
    bound: Arc<Bound>,
    key: RouteKey,
    writer: Weak<Mutex<Writer>>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        // Only its own route: the rank's next feed may have registered already (the engine's
        // entry was replaced, and the old feed's task is dropped after the new one starts).
        let mut routes = self.bound.routes();
        if (routes.get(&self.key)).is_some_and(|r| Weak::ptr_eq(&r.writer, &self.writer)) {
            routes.remove(&self.key);
        }
    }
}

/// Why a publisher was refused.
#[derive(Debug, Clone, Copy)]
enum Refused {
    Stranger,
    Full,
    Duplicate,
    Oversized,
    Slow,
}

impl Listeners {
    /// Endpoints whose refusals are counted in `refused`.
    pub fn new(refused: Arc<Refusals>) -> Listeners {
        Listeners {
            bound: Mutex::default(),
            refused,
        }
    }

    /// What its endpoints refused.
    pub fn refused(&self) -> &Refusals {
        &self.refused
    }

    /// Routes rank `rank`'s messages on `topic` arriving at `addr` from one of the addresses
    /// `from` to `writer`, binding `addr` on first use. Refused (with why) when another rank
    /// already has that topic and rank there, or the address cannot be bound.
    pub async fn register(
        &self,
        addr: SocketAddr,
        topic: Vec<u8>,
        rank: u32,
        from: Arc<[IpAddr]>,
        writer: &SharedWriter,
    ) -> Result<Registration, String> {
        let existing = self
            .bound
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&addr)
            .cloned();
        let bound = match existing {
            Some(b) => b,
            None => {
                let listener = TcpListener::bind(addr)
                    .await
                    .map_err(|e| format!("cannot bind {addr} for the engine to publish to: {e}"))?;
                let b = Arc::new(Bound {
                    addr,
                    routes: Mutex::default(),
                    refused: self.refused.clone(),
                    log: Throttle::new(LOG_EVERY),
                });
                tokio::spawn(accept(listener, Arc::downgrade(&b)));
                let mut map = self.bound.lock().unwrap_or_else(|p| p.into_inner());
                map.entry(addr).or_insert(b).clone()
            }
        };
        let key = (topic, rank);
        let mut routes = bound.routes();
        let live = routes.get(&key).and_then(|r| r.writer.upgrade());
        // The same rank's index is its feed restarting (the old one is going), not another's.
        let taken = live.is_some_and(|w| {
            !Arc::ptr_eq(&w, writer) && !Arc::ptr_eq(lock(&w).index(), lock(writer).index())
        });
        if taken {
            return Err(format!(
                "another engine's rank {rank} already publishes to {addr} on topic {:?}: give each engine its own topic or port",
                String::from_utf8_lossy(&key.0)
            ));
        }
        let route = Route {
            writer: Arc::downgrade(writer),
            from: from.iter().map(|ip| ip.to_canonical()).collect(),
            claim: Claim::new(),
        };
        routes.insert(key.clone(), route);
        drop(routes);
        Ok(Registration {
            bound,
            key,
            writer: Arc::downgrade(writer),
        })
    }
}

impl Bound {
    fn routes(&self) -> std::sync::MutexGuard<'_, HashMap<RouteKey, Route>> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether some rank publishing here trusts `ip`.
    fn trusts(&self, ip: IpAddr) -> bool {
        (self.routes().values()).any(|r| r.writer.strong_count() > 0 && r.from.contains(&ip))
    }

    /// Counts a refusal, and logs it unless one was logged within [`LOG_EVERY`].
    fn refuse(&self, why: Refused, peer: SocketAddr, says: &str) {
        let c = &self.refused;
        let counter = match why {
            Refused::Stranger => &c.stranger,
            Refused::Full => &c.full,
            Refused::Duplicate => &c.duplicate,
            Refused::Oversized => &c.oversized,
            Refused::Slow => &c.slow,
        };
        counter.fetch_add(1, Relaxed);
        if let Some(held_back) = self.log.allow() {
            tracing::warn!(
                endpoint = %self.addr,
                %peer,
                held_back,
                "KV-event publisher refused: {says}"
            );
        }
    }
}

/// Accepts publishers on a bound endpoint until nobody routes to it any more.
async fn accept(listener: TcpListener, bound: Weak<Bound>) {
    let slots = Arc::new(Semaphore::new(MAX_PUBLISHERS));
    loop {
        let Ok((s, peer)) = listener.accept().await else {
            continue;
        };
        let Some(b) = bound.upgrade() else { return };
        // Closed before a byte is read or written: a stranger learns only that the port is open.
        if !b.trusts(peer.ip().to_canonical()) {
            b.refuse(
                Refused::Stranger,
                peer,
                "not an address of an engine publishing here (engines[].kv_events_from adds one)",
            );
            continue;
        }
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            b.refuse(
                Refused::Full,
                peer,
                &format!("{MAX_PUBLISHERS} publishers already connected"),
            );
            continue;
        };
        tokio::spawn(publisher(s, peer, b, slot));
    }
}

/// Reads one trusted peer's messages into the ranks it claims, until it goes.
async fn publisher(s: TcpStream, peer: SocketAddr, b: Arc<Bound>, _slot: OwnedSemaphorePermit) {
    let ip = peer.ip().to_canonical();
    let _ = s.set_nodelay(true);
    let mut sub = match Subscriber::start(s, b"", MAX_PAYLOAD as u64 + 64).await {
        Ok(sub) => sub.with_deadline(MESSAGE_DEADLINE),
        Err(e) => {
            tracing::debug!(%peer, error = %e, "KV-event publisher refused");
            return;
        }
    };
    // The ranks this connection claimed, with their claims: told when it goes.
    let mut held: Vec<(SharedWriter, Arc<Claim>, OwnedSemaphorePermit)> = Vec::new();
    // Notified when a newcomer takes over a rank this connection left silent.
    let kick = Arc::new(Notify::new());
    let why = loop {
        let received = tokio::select! {
            r = sub.recv() => r,
            // The connection is closed either way, so the message in progress is not needed.
            () = kick.notified() => break format!(
                "silent for {} s while another connection claimed its rank: replaced",
                STALE_CLAIM.as_secs()
            ),
        };
        let frames = match received {
            Ok(f) => f,
            Err(e) => {
                match e {
                    ZmtpError::TooBig(..) | ZmtpError::TooManyParts(_) => {
                        b.refuse(Refused::Oversized, peer, &e.to_string())
                    }
                    ZmtpError::Deadline(_) => b.refuse(Refused::Slow, peer, &e.to_string()),
                    _ => {}
                }
                break describe(e);
            }
        };
        let m = match decode(&frames) {
            Ok(m) => m,
            Err(e) => {
                for (w, _, _) in &held {
                    lock(w).undecodable(&e.to_string());
                }
                continue;
            }
        };
        let Some((w, claim)) = route(&b.routes(), &m.topic, m.batch.dp_rank, ip) else {
            continue;
        };
        if !held.iter().any(|(h, _, _)| Arc::ptr_eq(h, &w)) {
            match claim.take(&kick).await {
                Some(permit) => held.push((w.clone(), claim.clone(), permit)),
                None => {
                    let says = format!(
                        "rank {} on topic {:?} already has a publisher connected",
                        m.batch.dp_rank.map_or("?".into(), |r| r.to_string()),
                        String::from_utf8_lossy(&m.topic)
                    );
                    b.refuse(Refused::Duplicate, peer, &says);
                    break says;
                }
            }
        }
        super::replay::deliver(&w, &m).await;
        claim.heard();
    };
    // Each rank is told before its claim is let go, so a successor's messages come after.
    for (w, claim, permit) in held {
        lock(&w).lost(&format!("publisher {peer}: {why}"));
        *claim.holder() = None;
        drop(permit);
    }
}

/// The rank a message from `ip` on a bound endpoint is for: by its topic (or the empty topic,
/// which takes every message) and the batch's `data_parallel_rank`, among the ranks whose
/// engine publishes from `ip`; a batch without a rank (SGLang's) is for the only such rank
/// publishing on that topic here (each DP rank has its own port).
fn route(
    routes: &HashMap<RouteKey, Route>,
    topic: &[u8],
    rank: Option<u32>,
    ip: IpAddr,
) -> Option<(SharedWriter, Arc<Claim>)> {
    let matches =
        |k: &RouteKey, r: &Route| (k.0 == topic || k.0.is_empty()) && r.from.contains(&ip);
    let found = match rank {
        Some(n) => routes.iter().find(|(k, r)| k.1 == n && matches(k, r)),
        None => {
            let mut on_topic = routes.iter().filter(|(k, r)| matches(k, r));
            match (on_topic.next(), on_topic.next()) {
                (Some(one), None) => Some(one),
                _ => None,
            }
        }
    };
    let (_, r) = found?;
    Some((r.writer.upgrade()?, r.claim.clone()))
}

#[cfg(test)]
mod tests {
    use super::super::feed::writer;
    use super::*;

    fn at(w: &SharedWriter, from: &str) -> Route {
        Route {
            writer: Arc::downgrade(w),
            from: [from.parse().unwrap()].into(),
            claim: Claim::new(),
        }
    }

    #[test]
    fn messages_on_a_bound_endpoint_find_their_rank_from_its_engines_address() {
        let (a, b) = (writer(&Arc::default()), writer(&Arc::default()));
        let engine: IpAddr = "10.0.0.5".parse().unwrap();
        let stranger: IpAddr = "10.0.0.6".parse().unwrap();
        let mut routes = HashMap::new();
        routes.insert((b"kv".to_vec(), 3), at(&a, "10.0.0.5"));
        let is = |w: Option<(SharedWriter, Arc<Claim>)>, x: &SharedWriter| {
            w.is_some_and(|(w, _)| Arc::ptr_eq(&w, x))
        };
        assert!(is(route(&routes, b"kv", Some(3), engine), &a));
        assert!(route(&routes, b"kv", Some(3), stranger).is_none());
        assert!(route(&routes, b"kv", Some(4), engine).is_none());
        assert!(route(&routes, b"other", Some(3), engine).is_none());
        // SGLang's batches carry no rank: the endpoint's only rank on the topic takes them.
        assert!(is(route(&routes, b"kv", None, engine), &a));
        assert!(route(&routes, b"kv", None, stranger).is_none());
        routes.insert((b"kv".to_vec(), 4), at(&b, "10.0.0.5"));
        assert!(
            route(&routes, b"kv", None, engine).is_none(),
            "two ranks: which one is unknown"
        );
    }
}
