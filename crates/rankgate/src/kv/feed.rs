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
//! Trust: rankgate connects only to the engine's own host, binds only where the operator's
//! `engines[].kv_events` says or, from the engine's `/kv_event_sources`, an address of the
//! engine itself, for at most the engine's ranks ([`trusted`]); who may publish on a bound
//! endpoint is [`super::listen`]'s concern.
//!
//! Per rank one [`Writer`] behind a mutex that only the event tasks take (picks read the index
//! without it). A task that loses its publisher marks the rank unavailable and reconnects with
//! a backoff; in-flight requests and other ranks are untouched.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpStream;

use super::event::{decode, MAX_PAYLOAD};
use super::index::RankIndex;
use super::writer::Writer;
use super::zmtp::{Subscriber, ZmtpError};
use crate::config::KvEndpoint;

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
    /// The engine's replay socket for the rank ([`super::replay`]), if it has one.
    pub replay: Option<Replay>,
}

/// Where a rank's replay socket is: the engine always binds it, so rankgate connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    /// `host:port` to connect to.
    pub addr: String,
    /// The address the engine named, when it named one rather than every interface (`*`):
    /// from `/kv_event_sources`, it must be one of the engine's own ([`trusted`]).
    pub named: Option<IpAddr>,
}

/// The replay socket of the rank `offset` ranks past the endpoint's (vLLM adds the rank to the
/// port): the engine's host for `*`, else the address named, which must be an IP address.
pub fn replay_at(ep: &KvEndpoint, offset: u32, engine_host: &str) -> Result<Replay, String> {
    let port = (ep.port_of(offset)).ok_or_else(|| format!("replay port + {offset} past 65535"))?;
    Ok(match ep.host.as_deref() {
        None => Replay {
            addr: join(engine_host, port),
            named: None,
        },
        Some(h) => {
            let ip: IpAddr = h
                .parse()
                .map_err(|_| format!("replay endpoint host {h:?}: give an IP address (or *)"))?;
            Replay {
                addr: SocketAddr::new(ip, port).to_string(),
                named: Some(ip.to_canonical()),
            }
        }
    })
}

/// The sources of ranks `first..first + count` from `engines[].kv_events`; `engine_host` is the
/// host of the engine's URL.
pub fn from_config(
    endpoint: &KvEndpoint,
    topic: &str,
    replay: Option<&KvEndpoint>,
    engine_host: &str,
    first: u32,
    count: u32,
) -> Result<Vec<RankSource>, String> {
    (0..count)
        .map(|i| {
            let port = (endpoint.port_of(i))
                .ok_or_else(|| format!("rank {} past port 65535", first + i))?;
            Ok(RankSource {
                rank: first + i,
                reach: reach(endpoint, port, engine_host)?,
                topic: topic.as_bytes().to_vec(),
                replay: replay.map(|r| replay_at(r, i, engine_host)).transpose()?,
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
        // Each rank's entry names its own replay endpoint (the rank's port already added).
        let replay = match entry.get("replay_endpoint") {
            None | Some(serde_json::Value::Null) => None,
            Some(r) => {
                let r = r
                    .as_str()
                    .ok_or_else(|| at("replay_endpoint is not a string"))?;
                let ep = KvEndpoint::parse(r).map_err(|e| at(&format!("replay_endpoint {e}")))?;
                Some(replay_at(&ep, 0, engine_host).map_err(|e| at(&e))?)
            }
        };
        out.push(RankSource {
            rank,
            reach: reach(&ep, ep.port, engine_host).map_err(|e| at(&e))?,
            topic: topic.as_bytes().to_vec(),
            replay,
        });
    }
    out.sort_by_key(|s| s.rank);
    Ok(out)
}

/// Refuses an engine's `/kv_event_sources` answer that asks more of rankgate than the engine
/// is owed: more ranks than the engine has (ranks `first..first + count`), a rank not its own,
/// or a bound address that is not one of the engine's own (`engine`, what its URL's host
/// resolves to). An engine elsewhere that connects to rankgate is given its endpoint in
/// `engines[].kv_events`, the operator's word, instead.
pub fn trusted(
    sources: &[RankSource],
    first: u32,
    count: u32,
    engine: &[IpAddr],
) -> Result<(), String> {
    let refused = |why: String| Err(format!("/kv_event_sources refused: {why}"));
    if sources.len() > count as usize {
        return refused(format!(
            "it lists {} ranks, the engine has {count}",
            sources.len()
        ));
    }
    let last = first.saturating_add(count);
    for s in sources {
        if !(first..last).contains(&s.rank) {
            return refused(format!(
                "it lists rank {}, the engine's ranks are {first}..{}",
                s.rank,
                last.saturating_sub(1)
            ));
        }
        if let Some(ip) = s.replay.as_ref().and_then(|r| r.named) {
            if !engine.contains(&ip) {
                return refused(format!(
                    "rank {} names a replay socket at {ip}, not an address of the engine",
                    s.rank
                ));
            }
        }
        if let Reach::Bind(addr) = s.reach {
            if !engine.contains(&addr.ip().to_canonical()) {
                return refused(format!(
                    "rank {} asks rankgate to bind {addr}, not an address of the engine ({}); to bind it, write it in engines[].kv_events",
                    s.rank,
                    engine.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
                ));
            }
        }
    }
    Ok(())
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
/// A message must arrive whole within this of its first byte: real batches are KBs and take
/// milliseconds, and a publisher that starts a message and stalls holds its buffer.
pub const MESSAGE_DEADLINE: Duration = Duration::from_secs(5);
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
                    Ok(sub) => {
                        let mut sub = sub.with_deadline(MESSAGE_DEADLINE);
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
                Ok(m) => super::replay::deliver(writer, &m).await,
                Err(e) => lock(writer).undecodable(&e.to_string()),
            },
            Err(e) => return describe(e),
        }
    }
}

pub(super) fn describe(e: ZmtpError) -> String {
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

/// A fresh writer for `index` (its old content dropped: a new feed starts from nothing).
pub fn writer(index: &Arc<RankIndex>) -> SharedWriter {
    Arc::new(Mutex::new(Writer::new(index.clone())))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCES: &str =
        include_str!("../../../../tests/fixtures/vllm-0.32-kv-events/kv_event_sources.json");

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
                topic: b"kv".to_vec(),
                replay: None,
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
    fn an_engines_sources_may_bind_only_its_own_addresses_for_its_own_ranks() {
        let s = from_sources(SOURCES.as_bytes(), "127.0.0.1").unwrap();
        let local: [IpAddr; 1] = ["127.0.0.1".parse().unwrap()];
        assert_eq!(trusted(&s, 0, 2, &local), Ok(()));
        let elsewhere: [IpAddr; 1] = ["10.0.0.5".parse().unwrap()];
        let e = trusted(&s, 0, 2, &elsewhere).unwrap_err();
        assert!(
            e.contains("bind 127.0.0.1:5557, not an address of the engine (10.0.0.5)"),
            "{e}"
        );
        let e = trusted(&s, 0, 1, &local).unwrap_err();
        assert!(e.contains("it lists 2 ranks, the engine has 1"), "{e}");
        let e = trusted(&s, 1, 2, &local).unwrap_err();
        assert!(
            e.contains("it lists rank 0, the engine's ranks are 1..2"),
            "{e}"
        );
        // Three hundred ranks on another address, as a hostile engine might answer.
        let many: serde_json::Map<String, serde_json::Value> = (0..300)
            .map(|r| {
                let ep = format!("tcp://127.0.0.2:{}", 31600 + r);
                (
                    r.to_string(),
                    serde_json::json!({ "endpoint": ep, "topic": "kv" }),
                )
            })
            .collect();
        let body = serde_json::to_vec(&many).unwrap();
        let s = from_sources(&body, "127.0.0.1").unwrap();
        assert!(trusted(&s, 0, 2, &local).unwrap_err().contains("300 ranks"));
        // Connecting to the engine's own host needs no address check.
        let star = SOURCES.replace("127.0.0.1", "*");
        let s = from_sources(star.as_bytes(), "10.0.0.5").unwrap();
        assert_eq!(trusted(&s, 0, 2, &elsewhere), Ok(()));
    }

    #[test]
    fn configured_endpoints_add_the_rank_to_the_port() {
        let endpoint = KvEndpoint::parse("tcp://*:6000").unwrap();
        let s = from_config(&endpoint, "t", None, "::1", 4, 2).unwrap();
        assert_eq!(
            (s[0].rank, &s[0].reach),
            (4, &Reach::Connect("[::1]:6000".into()))
        );
        assert_eq!(s[1].reach, Reach::Connect("[::1]:6001".into()));
    }
}
