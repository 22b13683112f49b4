//! Where each rank's events come from, and the tasks that read them into its index.
//!
//! An engine's ranks are found in its `GET /kv_event_sources` (vLLM: one entry per DP rank) or
//! in `engines[].kv_events` (rank `r` at the port plus `r`). An endpoint means what it means to
//! the engine: with `*` (or `0.0.0.0`, `::`) the engine binds and rankgate connects to the
//! engine's host; with a concrete host the engine connects there, so rankgate binds it. A bound
//! endpoint may take several engines' ranks: a message's rank is the batch's
//! `data_parallel_rank`, its engine the topic it was published on (so engines sharing an
//! endpoint need topics of their own; a second engine on the same endpoint and topic is refused
//! and says so).
//!
//! Per rank one [`Writer`] behind a mutex that only the event tasks take (picks read the index
//! without it). A task that loses its publisher marks the rank unavailable and reconnects with
//! a backoff; in-flight requests and other ranks are untouched.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

use super::event::{decode, MAX_PAYLOAD};
use super::index::{RankIndex, Writer};
use super::zmtp::{Subscriber, ZmtpError};
use crate::config::{KvEndpoint, KvEvents};

/// One rank's writer, shared by whichever task reads its events.
pub type SharedWriter = Arc<Mutex<Writer>>;

/// How one rank's events are reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// The engine binds: rankgate connects to `host:port`.
    Connect(String),
    /// The engine connects: rankgate listens on this address.
    Bind(SocketAddr),
}

/// One rank's event source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankSource {
    /// Global DP rank.
    pub rank: u32,
    pub reach: Reach,
    pub topic: Vec<u8>,
}

/// The sources of ranks `first..first + count` from `engines[].kv_events`; `engine_host` is the
/// host of the engine's URL.
pub fn from_config(
    kv: &KvEvents,
    engine_host: &str,
    first: u32,
    count: u32,
) -> Result<Vec<RankSource>, String> {
    (0..count)
        .map(|i| {
            let port = kv
                .endpoint
                .port_of(i)
                .ok_or_else(|| format!("rank {} past port 65535", first + i))?;
            Ok(RankSource {
                rank: first + i,
                reach: reach(&kv.endpoint, port, engine_host)?,
                topic: kv.topic.as_bytes().to_vec(),
            })
        })
        .collect()
}

/// The sources `GET /kv_event_sources` lists: `{"<rank>": {"endpoint": "tcp://...",
/// "topic": "kv", "enable_kv_cache_events": true, "publisher": "zmq", ...}, ...}`. Ranks
/// whose events are off, or published some other way than ZeroMQ, are left out.
pub fn from_sources(body: &[u8], engine_host: &str) -> Result<Vec<RankSource>, String> {
    let v: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body)
        .map_err(|e| format!("/kv_event_sources: not a JSON object: {e}"))?;
    let mut out = Vec::new();
    for (rank, entry) in &v {
        let at = |what: &str| format!("/kv_event_sources[{rank:?}]: {what}");
        let rank: u32 = rank
            .parse()
            .map_err(|_| at("the key is not a rank number"))?;
        if entry
            .get("enable_kv_cache_events")
            .and_then(|e| e.as_bool())
            == Some(false)
        {
            continue;
        }
        if entry
            .get("publisher")
            .and_then(|p| p.as_str())
            .is_some_and(|p| p != "zmq")
        {
            continue;
        }
        let endpoint =
            (entry.get("endpoint").and_then(|e| e.as_str())).ok_or_else(|| at("no endpoint"))?;
        let ep = KvEndpoint::parse(endpoint).map_err(|e| at(&e))?;
        let topic = entry.get("topic").and_then(|t| t.as_str()).unwrap_or("");
        out.push(RankSource {
            rank,
            reach: reach(&ep, ep.port, engine_host).map_err(|e| at(&e))?,
            topic: topic.as_bytes().to_vec(),
        });
    }
    out.sort_by_key(|s| s.rank);
    Ok(out)
}

fn reach(ep: &KvEndpoint, port: u16, engine_host: &str) -> Result<Reach, String> {
    Ok(match ep.host.as_deref() {
        None => Reach::Connect(join(engine_host, port)),
        Some(h) => {
            let ip = h.parse().map_err(|_| {
                format!(
                    "the engine connects to {h:?}, which rankgate must bind: give an IP address"
                )
            })?;
            Reach::Bind(SocketAddr::new(ip, port))
        }
    })
}

fn join(host: &str, port: u16) -> String {
    match host.contains(':') && !host.starts_with('[') {
        true => format!("[{host}]:{port}"),
        false => format!("{host}:{port}"),
    }
}

/// Longest wait for a publisher's TCP connect (the handshake has its own bound).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Publishers one bound endpoint takes at once: each engine rank is one; more is a flood.
const MAX_PUBLISHERS: usize = 256;
/// Backoff between attempts to reach a publisher.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// Reads one rank's events from a publisher that binds, forever (the caller aborts it):
/// connects, subscribes to `topic`, applies each message; on any failure marks the rank
/// unavailable, waits, and connects again.
pub async fn connect_rank(addr: String, topic: Vec<u8>, writer: SharedWriter) {
    let mut wait = RETRY_MIN;
    loop {
        let why = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&addr)).await {
            Err(_) => format!("cannot connect within {} s", CONNECT_TIMEOUT.as_secs()),
            Ok(Err(e)) => format!("cannot connect: {e}"),
            Ok(Ok(s)) => {
                let _ = s.set_nodelay(true);
                match Subscriber::start(s, &topic, MAX_PAYLOAD as u64 + 64).await {
                    Ok(mut sub) => {
                        wait = RETRY_MIN;
                        read(&mut sub, &writer).await
                    }
                    Err(e) => e.to_string(),
                }
            }
        };
        lock(&writer).lost(&format!("publisher tcp://{addr}: {why}"));
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(RETRY_MAX);
    }
}

/// Applies messages until the connection fails; returns why.
async fn read(sub: &mut Subscriber<TcpStream>, writer: &SharedWriter) -> String {
    loop {
        match sub.recv().await {
            Ok(frames) => match decode(&frames) {
                Ok(m) => lock(writer).apply(&m),
                Err(e) => lock(writer).undecodable(&e.to_string()),
            },
            Err(e) => return describe(e),
        }
    }
}

fn describe(e: ZmtpError) -> String {
    match e {
        ZmtpError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            "connection closed".into()
        }
        e => e.to_string(),
    }
}

pub(crate) fn lock(w: &SharedWriter) -> std::sync::MutexGuard<'_, Writer> {
    w.lock().unwrap_or_else(|p| p.into_inner())
}

/// rankgate's bound endpoints, shared by every engine whose ranks connect to it.
#[derive(Default)]
pub struct Listeners {
    bound: Mutex<HashMap<SocketAddr, Arc<Bound>>>,
}

/// A rank's messages on a bound endpoint: its topic and DP rank.
type RouteKey = (Vec<u8>, u32);

/// One bound endpoint: the ranks that publish to it, by topic and DP rank.
#[derive(Default)]
struct Bound {
    routes: Mutex<HashMap<RouteKey, Weak<Mutex<Writer>>>>,
}

/// A rank's place on a bound endpoint; dropping it (the engine left) takes the rank off.
pub struct Registration {
    bound: Arc<Bound>,
    key: RouteKey,
}

impl Drop for Registration {
    fn drop(&mut self) {
        (self.bound.routes.lock().unwrap_or_else(|p| p.into_inner())).remove(&self.key);
    }
}

impl Listeners {
    /// Routes rank `rank`'s messages on `topic` arriving at `addr` to `writer`, binding `addr`
    /// on first use. Refused (with why) when another rank already has that topic and rank
    /// there, or the address cannot be bound.
    pub async fn register(
        &self,
        addr: SocketAddr,
        topic: Vec<u8>,
        rank: u32,
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
                let b = Arc::new(Bound::default());
                tokio::spawn(accept(listener, Arc::downgrade(&b)));
                let mut map = self.bound.lock().unwrap_or_else(|p| p.into_inner());
                map.entry(addr).or_insert(b).clone()
            }
        };
        let key = (topic, rank);
        let mut routes = bound.routes.lock().unwrap_or_else(|p| p.into_inner());
        if routes.get(&key).is_some_and(|w| w.strong_count() > 0) {
            return Err(format!(
                "another engine's rank {rank} already publishes to {addr} on topic {:?}: give each engine its own topic or port",
                String::from_utf8_lossy(&key.0)
            ));
        }
        routes.insert(key.clone(), Arc::downgrade(writer));
        drop(routes);
        Ok(Registration { bound, key })
    }
}

/// Accepts publishers on a bound endpoint until nobody routes to it any more.
async fn accept(listener: TcpListener, bound: Weak<Bound>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_PUBLISHERS));
    loop {
        let Ok((s, peer)) = listener.accept().await else {
            continue;
        };
        let Some(b) = bound.upgrade() else { return };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::warn!(%peer, "KV-event publisher refused: {MAX_PUBLISHERS} already connected");
            continue;
        };
        tokio::spawn(async move {
            let _slot = slot;
            let _ = s.set_nodelay(true);
            let mut sub = match Subscriber::start(s, b"", MAX_PAYLOAD as u64 + 64).await {
                Ok(sub) => sub,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "KV-event publisher refused");
                    return;
                }
            };
            // The ranks this publisher spoke for: told when it goes.
            let mut seen: Vec<SharedWriter> = Vec::new();
            let why = loop {
                let frames = match sub.recv().await {
                    Ok(f) => f,
                    Err(e) => break describe(e),
                };
                let m = match decode(&frames) {
                    Ok(m) => m,
                    Err(e) => {
                        for w in &seen {
                            lock(w).undecodable(&e.to_string());
                        }
                        continue;
                    }
                };
                let writer = {
                    let routes = b.routes.lock().unwrap_or_else(|p| p.into_inner());
                    route(&routes, &m.topic, m.batch.dp_rank)
                };
                let Some(w) = writer else { continue };
                lock(&w).apply(&m);
                if !seen.iter().any(|s| Arc::ptr_eq(s, &w)) {
                    seen.push(w);
                }
            };
            for w in seen {
                lock(&w).lost(&format!("publisher {peer}: {why}"));
            }
        });
    }
}

/// The rank a message on a bound endpoint is for: by its topic (or the empty topic, which takes
/// every message) and the batch's `data_parallel_rank`; a batch without one (SGLang's) is for
/// the only rank publishing on that topic here (each DP rank has its own port).
fn route(
    routes: &HashMap<RouteKey, Weak<Mutex<Writer>>>,
    topic: &[u8],
    rank: Option<u32>,
) -> Option<SharedWriter> {
    let matches = |k: &RouteKey| k.0 == topic || k.0.is_empty();
    match rank {
        Some(r) => (routes.iter())
            .find(|(k, _)| k.1 == r && matches(k))
            .and_then(|(_, w)| w.upgrade()),
        None => {
            let mut on_topic = routes.iter().filter(|(k, _)| matches(k));
            match (on_topic.next(), on_topic.next()) {
                (Some((_, w)), None) => w.upgrade(),
                _ => None,
            }
        }
    }
}

/// A fresh writer for `index` (its old content dropped: a new feed starts from nothing).
pub fn writer(index: &Arc<RankIndex>) -> SharedWriter {
    Arc::new(Mutex::new(Writer::new(index.clone())))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCES: &str =
        include_str!("../../tests/fixtures/vllm-0.32-kv-events/kv_event_sources.json");

    #[test]
    fn the_engines_sources_read_with_their_direction() {
        // The capture's engine had a concrete host: it connects, rankgate binds each port.
        let s = from_sources(SOURCES.as_bytes(), "10.0.0.5").unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(
            s[0],
            RankSource {
                rank: 0,
                reach: Reach::Bind("127.0.0.1:5557".parse().unwrap()),
                topic: b"kv".to_vec()
            }
        );
        assert_eq!(s[1].reach, Reach::Bind("127.0.0.1:5558".parse().unwrap()));
        let star = SOURCES.replace("127.0.0.1", "*");
        let s = from_sources(star.as_bytes(), "10.0.0.5").unwrap();
        assert_eq!(s[1].reach, Reach::Connect("10.0.0.5:5558".into()));
        for (bad, says) in [
            ("[]", "not a JSON object"),
            ("{\"x\":{}}", "not a rank"),
            ("{\"0\":{}}", "no endpoint"),
            (
                "{\"0\":{\"endpoint\":\"tcp://host.example:1\"}}",
                "give an IP",
            ),
        ] {
            let e = from_sources(bad.as_bytes(), "h").unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let off = "{\"0\":{\"endpoint\":\"tcp://*:1\",\"enable_kv_cache_events\":false}}";
        assert!(from_sources(off.as_bytes(), "h").unwrap().is_empty());
    }

    #[test]
    fn messages_on_a_bound_endpoint_find_their_rank() {
        let (a, b) = (writer(&Arc::default()), writer(&Arc::default()));
        let mut routes = HashMap::new();
        routes.insert((b"kv".to_vec(), 3), Arc::downgrade(&a));
        let is = |w: Option<SharedWriter>, x: &SharedWriter| w.is_some_and(|w| Arc::ptr_eq(&w, x));
        assert!(is(route(&routes, b"kv", Some(3)), &a));
        assert!(route(&routes, b"kv", Some(4)).is_none());
        assert!(route(&routes, b"other", Some(3)).is_none());
        // SGLang's batches carry no rank: the endpoint's only rank on the topic takes them.
        assert!(is(route(&routes, b"kv", None), &a));
        routes.insert((b"kv".to_vec(), 4), Arc::downgrade(&b));
        assert!(
            route(&routes, b"kv", None).is_none(),
            "two ranks: which one is unknown"
        );
    }

    #[test]
    fn configured_endpoints_add_the_rank_to_the_port() {
        let kv = KvEvents {
            endpoint: KvEndpoint::parse("tcp://*:6000").unwrap(),
            topic: "t".into(),
        };
        let s = from_config(&kv, "::1", 4, 2).unwrap();
        assert_eq!(
            (s[0].rank, &s[0].reach),
            (4, &Reach::Connect("[::1]:6000".into()))
        );
        assert_eq!(s[1].reach, Reach::Connect("[::1]:6001".into()));
    }
}
