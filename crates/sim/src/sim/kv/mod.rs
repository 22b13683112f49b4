//! KV-cache events, as vLLM publishes them with `--kv-events-config`: every block a rank's
//! prefix cache stores or evicts, and a clear on restart, sent per DP rank over a ZeroMQ PUB
//! socket in vLLM 0.32's framing and msgpack ([`event`]), so a router's subscriber and index are
//! tested against the sim as against a real engine.
//!
//! The pieces, from the cache to the wire:
//! - the rank's [`super::prefix::PrefixCache`] records events as it changes, under the rank's
//!   lock, and the rank hands them to its [`RankEvents`] journal in that same critical section
//!   (so their order is the cache's);
//! - one publisher task per rank takes whatever the journal holds as one batch (about one
//!   scheduling step), numbers it (per rank, from 0), encodes it and offers it to every connected
//!   subscriber ([`Hub`]);
//! - each subscriber connection has its own bounded queue that drops its oldest message when
//!   full, so a slow or stalled subscriber loses messages (and sees the gap in the sequence
//!   numbers) but never slows the publisher, let alone a request.
//!
//! Direction follows vLLM: `tcp://*:PORT` binds (subscribers connect), a concrete host connects
//! there (the subscriber binds); DP rank r uses PORT + r (r the global rank, as vLLM offsets by
//! its `data_parallel_rank`). Sim-only: binding port 0 gives each rank its own free port, read
//! back with [`super::SimEngine::kv_event_endpoints`] and `GET /kv_event_sources`.

mod config;
pub mod event;
pub mod msgpack;
mod replay;

pub use config::{parse_endpoint, KvConfigError, KvEndpoint, KvEventsConfig};
/// ZeroMQ's wire protocol: the router's own (its subscriber and this publisher speak the same).
pub use rankgate::kv::zmtp;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};

use event::KvEvent;
use zmtp::{SubRequest, ZmtpError};

/// `port + rank`, or `None` past 65535.
fn offset(port: u16, rank: u32) -> Option<u16> {
    u16::try_from(u32::from(port) + rank).ok()
}

/// Events a rank's cache produced that its publisher has not sent yet.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    pub(crate) events: Vec<KvEvent>,
    /// Events were dropped here (the publisher fell far behind): the next batch skips a
    /// sequence number so subscribers see the gap.
    pub(crate) lost: bool,
    /// The rank restarted: the next batch is numbered 0 again.
    pub(crate) restarted: bool,
}

/// The most events a rank holds for its publisher; past it the oldest go (and a sequence number
/// is skipped). The publisher drains the journal on every wake-up, so this only bites when its
/// task is starved.
const MAX_PENDING: usize = 1 << 16;

/// A rank's events on their way from its cache to its publisher.
#[derive(Debug, Default)]
pub struct RankEvents {
    pending: Mutex<Pending>,
    wake: Notify,
}

impl RankEvents {
    /// Queues the events of one cache operation.
    pub(crate) fn push(&self, mut events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        {
            let mut p = lock(&self.pending);
            let over = (p.events.len() + events.len()).saturating_sub(MAX_PENDING);
            if over > 0 {
                let from_old = over.min(p.events.len());
                p.events.drain(..from_old);
                events.drain(..(over - from_old).min(events.len()));
                p.lost = true;
            }
            p.events.append(&mut events);
        }
        self.wake.notify_one();
    }

    /// The rank restarted: what was not sent is lost with the old process, numbering starts
    /// again at 0, and the first batch says the cache is empty.
    pub(crate) fn restart(&self) {
        {
            let mut p = lock(&self.pending);
            *p = Pending {
                events: vec![KvEvent::AllBlocksCleared],
                lost: false,
                restarted: true,
            };
        }
        self.wake.notify_one();
    }

    pub(crate) fn take(&self) -> Pending {
        std::mem::take(&mut *lock(&self.pending))
    }
}

/// One subscriber connection's side of the publisher: what it subscribed to and the messages
/// waiting for it.
#[derive(Debug, Default)]
struct Peer {
    state: Mutex<PeerState>,
    wake: Notify,
}

#[derive(Debug, Default)]
struct PeerState {
    topics: Vec<Vec<u8>>,
    queue: VecDeque<Bytes>,
    /// Messages dropped because the queue was full.
    dropped: u64,
    closed: bool,
}

/// The most topic prefixes one subscriber may hold.
const MAX_TOPICS: usize = 1024;

/// A rank's subscribers.
#[derive(Debug)]
pub(crate) struct Hub {
    peers: Mutex<Vec<Arc<Peer>>>,
    hwm: usize,
    dropped: std::sync::atomic::AtomicU64,
}

impl Hub {
    fn new(hwm: usize) -> Hub {
        Hub {
            peers: Mutex::new(Vec::new()),
            hwm: hwm.max(1),
            dropped: Default::default(),
        }
    }

    fn add(&self) -> Arc<Peer> {
        let p = Arc::new(Peer::default());
        lock(&self.peers).push(p.clone());
        p
    }

    /// Offers a message to every subscriber whose subscriptions match `topic`; never waits.
    fn publish(&self, topic: &[u8], msg: &Bytes) {
        let mut peers = lock(&self.peers);
        peers.retain(|p| !lock(&p.state).closed);
        for p in peers.iter() {
            let mut s = lock(&p.state);
            if !s.topics.iter().any(|t| topic.starts_with(t)) {
                continue;
            }
            if s.queue.len() >= self.hwm {
                s.queue.pop_front();
                s.dropped += 1;
                self.dropped
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            s.queue.push_back(msg.clone());
            drop(s);
            p.wake.notify_one();
        }
    }

    fn subscribers(&self) -> usize {
        lock(&self.peers)
            .iter()
            .filter(|p| {
                let s = lock(&p.state);
                !s.closed && !s.topics.is_empty()
            })
            .count()
    }
}

/// Serves one subscriber connection until it ends: handshake, then its subscriptions in and
/// its messages out.
async fn serve_peer(mut stream: TcpStream, peer: Arc<Peer>, hwm: usize) -> Result<(), ZmtpError> {
    let _ = stream.set_nodelay(true);
    let result = async {
        zmtp::handshake(&mut stream, "PUB", &["SUB", "XSUB"]).await?;
        let (mut rd, mut wr) = stream.split();
        let reader = async {
            loop {
                let f = match zmtp::read_frame(&mut rd, zmtp::MAX_INCOMING_FRAME).await {
                    Ok(f) => f,
                    Err(e) => return e,
                };
                match zmtp::sub_request(f) {
                    SubRequest::Subscribe(t) => {
                        let mut s = lock(&peer.state);
                        // A peer cannot grow our memory without bound by subscribing forever.
                        if s.topics.len() < MAX_TOPICS {
                            s.topics.push(t);
                        }
                    }
                    SubRequest::Cancel(t) => {
                        let mut s = lock(&peer.state);
                        if let Some(i) = s.topics.iter().position(|x| *x == t) {
                            s.topics.remove(i);
                        }
                    }
                    SubRequest::Ping(pong) => {
                        // Queued like a message so that writes stay in one task, within the
                        // same bound (a peer that pings and never reads gets no more).
                        let mut s = lock(&peer.state);
                        if s.queue.len() < hwm {
                            s.queue.push_back(pong.into());
                        }
                        drop(s);
                        peer.wake.notify_one();
                    }
                    SubRequest::Other => {}
                }
            }
        };
        let writer = async {
            loop {
                peer.wake.notified().await;
                loop {
                    let next = lock(&peer.state).queue.pop_front();
                    let Some(msg) = next else { break };
                    if let Err(e) = wr.write_all(&msg).await {
                        return e;
                    }
                }
            }
        };
        Err(tokio::select! {
            e = reader => e,
            e = writer => ZmtpError::Io(e),
        })
    }
    .await;
    let mut s = lock(&peer.state);
    s.closed = true;
    s.queue.clear();
    result
}

/// A rank's running publisher: where it listens (bind) or what it dials (connect).
#[derive(Debug, Clone)]
pub(crate) struct RankPublisher {
    pub(crate) rank: u32,
    /// `tcp://*:PORT` with the port really bound, or the `tcp://HOST:PORT` dialled.
    pub(crate) endpoint: String,
    /// The address bound, in bind mode.
    pub(crate) bound: Option<SocketAddr>,
    /// The replay socket's address, when the config asks for one.
    pub(crate) replay: Option<SocketAddr>,
    hub: Arc<Hub>,
}

impl RankPublisher {
    /// Subscribers connected and subscribed right now.
    pub(crate) fn subscribers(&self) -> usize {
        self.hub.subscribers()
    }

    /// Messages dropped because a subscriber's queue was full, ever.
    pub(crate) fn dropped(&self) -> u64 {
        self.hub.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Starts rank `rank`'s publisher: its socket (bound now, so the port is known when this
/// returns; or dialled in the background) and the task that turns `events` into messages. All
/// of it stops when `stop` turns true or its sender goes.
pub(crate) async fn start(
    cfg: &KvEventsConfig,
    rank: u32,
    events: Arc<RankEvents>,
    stop: watch::Receiver<bool>,
) -> std::io::Result<RankPublisher> {
    let hub = Arc::new(Hub::new(cfg.hwm));
    let too_far = || {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("kv events: port + rank {rank} is past 65535"),
        )
    };
    let (endpoint, bound) = match &cfg.endpoint {
        KvEndpoint::Bind { host, port } => {
            let port = if *port == 0 {
                0
            } else {
                offset(*port, rank).ok_or_else(too_far)?
            };
            let listener = TcpListener::bind(SocketAddr::new(*host, port)).await?;
            let addr = listener.local_addr()?;
            tokio::spawn(accept(listener, hub.clone(), stop.clone()));
            (format!("tcp://*:{}", addr.port()), Some(addr))
        }
        KvEndpoint::Connect { host, port } => {
            let port = offset(*port, rank).ok_or_else(too_far)?;
            tokio::spawn(dial(host.clone(), port, hub.clone(), stop.clone()));
            (format!("tcp://{host}:{port}"), None)
        }
    };
    let (buffer, replay) = match cfg.replay {
        None => (None, None),
        Some(at) => {
            let port = match at.port() {
                0 => 0,
                p => offset(p, rank).ok_or_else(too_far)?,
            };
            let buffer = Arc::new(replay::Buffer::new(cfg.buffer_steps));
            let addr =
                replay::start(SocketAddr::new(at.ip(), port), buffer.clone(), stop.clone()).await?;
            (Some(buffer), Some(addr))
        }
    };
    tokio::spawn(publish(
        rank,
        cfg.topic.clone().into_bytes(),
        events,
        hub.clone(),
        buffer,
        stop,
    ));
    Ok(RankPublisher {
        rank,
        endpoint,
        bound,
        replay,
        hub,
    })
}

/// Resolves once `stop` is true or its sender is gone.
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

async fn accept(listener: TcpListener, hub: Arc<Hub>, mut stop: watch::Receiver<bool>) {
    loop {
        let conn = tokio::select! {
            c = listener.accept() => c,
            _ = stopped(&mut stop) => return,
        };
        match conn {
            Ok((stream, _)) => {
                let peer = hub.add();
                let mut stop = stop.clone();
                let hwm = hub.hwm;
                tokio::spawn(async move {
                    tokio::select! {
                        r = serve_peer(stream, peer, hwm) => {
                            if let Err(e) = r {
                                tracing::debug!("kv events subscriber gone: {e}");
                            }
                        }
                        _ = stopped(&mut stop) => {}
                    }
                });
            }
            // Out of descriptors and the like: wait a little rather than spin.
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Dials the subscriber's address and serves the connection, again and again (libzmq's
/// reconnect: 100 ms, backing off to 5 s while it fails) until stopped.
async fn dial(host: String, port: u16, hub: Arc<Hub>, mut stop: watch::Receiver<bool>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let attempt = async {
            let stream = TcpStream::connect((host.as_str(), port)).await?;
            let peer = hub.add();
            serve_peer(stream, peer, hub.hwm).await
        };
        let ok = tokio::select! {
            r = attempt => r.is_ok(),
            _ = stopped(&mut stop) => return,
        };
        backoff = if ok {
            Duration::from_millis(100)
        } else {
            (backoff * 2).min(Duration::from_secs(5))
        };
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stopped(&mut stop) => return,
        }
    }
}

/// Turns the rank's events into numbered batches, one per wake-up, until stopped.
async fn publish(
    rank: u32,
    topic: Vec<u8>,
    events: Arc<RankEvents>,
    hub: Arc<Hub>,
    buffer: Option<Arc<replay::Buffer>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut seq: u64 = 0;
    loop {
        tokio::select! {
            _ = events.wake.notified() => {}
            _ = stopped(&mut stop) => return,
        }
        let p = events.take();
        if p.restarted {
            seq = 0;
            if let Some(b) = &buffer {
                b.clear();
            }
        }
        if p.lost {
            seq += 1;
        }
        if p.events.is_empty() {
            continue;
        }
        // Nobody listening and nothing to replay later: the number still counts (a subscriber
        // arriving later sees where the stream is), the encoding is saved.
        if hub.subscribers() == 0 && buffer.is_none() {
            seq += 1;
            continue;
        }
        let payload = event::encode_batch(event::now_ts(), &p.events, rank);
        if let Some(b) = &buffer {
            b.push(seq, Bytes::copy_from_slice(&payload));
        }
        let msg = zmtp::message(&[&topic, &seq.to_be_bytes(), &payload]);
        hub.publish(&topic, &msg);
        seq += 1;
    }
}

/// `GET /kv_event_sources`: per global rank (as a string key), the rank's events config with
/// its own endpoint, as vLLM answers it.
pub(crate) fn sources(cfg: &KvEventsConfig, publishers: &[RankPublisher]) -> Value {
    let mut m = serde_json::Map::new();
    for p in publishers {
        m.insert(
            p.rank.to_string(),
            json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": p.endpoint,
                "replay_endpoint": p.replay.map(|a| match a.ip().is_unspecified() {
                    true => format!("tcp://*:{}", a.port()),
                    false => format!("tcp://{a}"),
                }),
                "buffer_steps": cfg.buffer_steps,
                "hwm": cfg.hwm,
                "max_queue_size": cfg.max_queue_size,
                "topic": cfg.topic,
            }),
        );
    }
    Value::Object(m)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests;
