//! Whom a KV-event endpoint rankgate binds takes events from, over real TCP on loopback: the
//! engine's own address (127.0.0.1 here) publishes; a stranger (127.0.0.2) is closed at accept
//! and changes no index, no availability and no pick; a second publisher for a rank whose first
//! is connected is refused; an oversized or stalled message ends its connection; and an engine's
//! `/kv_event_sources` cannot make rankgate bind addresses that are not its own.

mod common;

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rankgate::kv::feed::{self, SharedWriter};
use rankgate::kv::listen::{Listeners, Registration, CLAIM_WAIT, STALE_CLAIM};
use rankgate::kv::zmtp::{self, read_frame};
use rankgate::kv::{KvState, RankIndex};
use rankgate_sim::sim::kv::event::{encode_batch, KvEvent};
use rankgate_sim::sim::kv::{KvEndpoint, KvEventsConfig};
use rankgate_sim::sim::{model, SimConfig, SimEngine, SimFlavor};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

const WAIT: Duration = Duration::from_secs(15);
const CAPTURE: &str = include_str!("fixtures/vllm-0.32-kv-events/events-dp2.jsonl");

/// The capture's first payload of rank 0 (three stored blocks of 128 tokens).
fn payload() -> Vec<u8> {
    let msgs = rankgate::kv::capture::read(CAPTURE).unwrap();
    let first = msgs.iter().find(|m| m.rank == 0).unwrap();
    first.frames[2].clone()
}

/// A free port on `ip` (bound, read back, released).
async fn free_port(ip: &str) -> u16 {
    let l = TcpListener::bind((ip, 0)).await.unwrap();
    l.local_addr().unwrap().port()
}

/// A TCP connection to `to` from the loopback address `from`.
async fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(SocketAddr::new(from.parse().unwrap(), 0)).unwrap();
    s.connect(to).await.unwrap()
}

/// Whether the peer closed `s` (EOF or reset) within [`WAIT`], reading and dropping anything
/// it sent before.
async fn closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 512];
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

/// Handshakes as the engine's PUB socket and reads the subscription.
async fn publisher(from: &str, to: SocketAddr) -> TcpStream {
    let mut s = connect_from(from, to).await;
    zmtp::handshake(&mut s, "PUB", &["SUB"]).await.unwrap();
    let _subscription = read_frame(&mut s, 1024).await.unwrap();
    s
}

async fn send(s: &mut TcpStream, seq: u64, payload: &[u8]) -> std::io::Result<()> {
    let frames: [&[u8]; 3] = [b"kv", &seq.to_be_bytes(), payload];
    s.write_all(&zmtp::message(&frames)).await
}

/// A bound endpoint on 127.0.0.1 for rank 0 on topic `kv` of an engine at 127.0.0.1.
async fn endpoint(
    listeners: &Listeners,
) -> (SocketAddr, Arc<RankIndex>, SharedWriter, Registration) {
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port("127.0.0.1").await));
    let index = Arc::new(RankIndex::default());
    let writer = feed::writer(&index);
    let engine: Arc<[IpAddr]> = ["127.0.0.1".parse().unwrap()].into();
    let reg = (listeners
        .register(addr, b"kv".to_vec(), 0, engine, &writer)
        .await)
        .unwrap();
    (addr, index, writer, reg)
}

#[tokio::test]
async fn a_stranger_is_closed_at_accept_and_touches_no_rank() {
    let listeners = Listeners::default();
    let (addr, index, _w, _reg) = endpoint(&listeners).await;
    let mut engine = publisher("127.0.0.1", addr).await;
    send(&mut engine, 0, &payload()).await.unwrap();
    until("the engine's first message applied", WAIT, || {
        index.block_size().is_some()
    })
    .await;
    let before = (index.state(), index.counts.messages.load(Relaxed));

    // The stranger connects, would say "sequence 0, exact from here", and goes.
    for _ in 0..3 {
        let mut s = connect_from("127.0.0.2", addr).await;
        let _ = s.write_all(&zmtp::greeting()).await;
        assert!(closed(&mut s).await, "a stranger's connection is closed");
    }
    until("the strangers counted", WAIT, || {
        listeners.refused().stranger.load(Relaxed) == 3
    })
    .await;
    assert_eq!((index.state(), index.counts.messages.load(Relaxed)), before);
    assert!(matches!(
        index.state(),
        KvState::Available { blocks: 3, .. }
    ));
    // The engine's own connection carries on.
    send(&mut engine, 1, &payload()).await.unwrap();
    until("the engine's next message applied", WAIT, || {
        index.counts.messages.load(Relaxed) == 2
    })
    .await;
    assert!(index.block_size().is_some());
}

#[tokio::test]
async fn a_second_publisher_for_a_connected_rank_is_refused_and_a_gone_one_replaced() {
    let listeners = Listeners::default();
    let (addr, index, _w, _reg) = endpoint(&listeners).await;
    let mut first = publisher("127.0.0.1", addr).await;
    send(&mut first, 0, &payload()).await.unwrap();
    until("the first publisher's message applied", WAIT, || {
        index.counts.messages.load(Relaxed) == 1
    })
    .await;
    // Same address, same rank and topic, while the first is connected: refused after waiting
    // for the first to go, its message never applied.
    let mut second = publisher("127.0.0.1", addr).await;
    send(&mut second, 0, &payload()).await.unwrap();
    assert!(closed(&mut second).await, "the second publisher is closed");
    assert_eq!(listeners.refused().duplicate.load(Relaxed), 1);
    assert_eq!(index.counts.messages.load(Relaxed), 1);
    assert!(index.block_size().is_some(), "the rank kept its publisher");
    // The first goes (an engine restarting): its successor takes the rank.
    drop(first);
    until(
        "the first publisher's loss seen",
        WAIT,
        || matches!(index.state(), KvState::Unavailable { reason } if reason.contains("publisher")),
    )
    .await;
    let mut third = publisher("127.0.0.1", addr).await;
    send(&mut third, 1, &payload()).await.unwrap();
    until("the successor's message applied", WAIT, || {
        index.counts.messages.load(Relaxed) == 2 && index.block_size().is_some()
    })
    .await;
    assert!(CLAIM_WAIT < WAIT);
}

#[tokio::test]
async fn an_oversized_frame_is_refused_from_its_header_and_a_stalled_message_dropped() {
    let listeners = Listeners::default();
    let (addr, index, _w, _reg) = endpoint(&listeners).await;
    // A 31 MiB frame announced, one byte sent: closed at the header, nothing allocated for it.
    let mut s = publisher("127.0.0.1", addr).await;
    let mut head = vec![0x02u8];
    head.extend_from_slice(&(31u64 << 20).to_be_bytes());
    head.push(0);
    s.write_all(&head).await.unwrap();
    assert!(
        closed(&mut s).await,
        "an oversized frame ends its connection"
    );
    assert_eq!(listeners.refused().oversized.load(Relaxed), 1);
    // A message started and never finished: dropped when its deadline passes.
    let mut s = publisher("127.0.0.1", addr).await;
    let mut part = vec![0x01u8, 2, b'k', b'v', 0x02];
    part.extend_from_slice(&1000u64.to_be_bytes());
    part.extend_from_slice(&[0; 10]);
    s.write_all(&part).await.unwrap();
    assert!(
        closed(&mut s).await,
        "a stalled message ends its connection"
    );
    assert_eq!(listeners.refused().slow.load(Relaxed), 1);
    assert_eq!(index.counts.messages.load(Relaxed), 0);
}

/// An engine at 127.0.0.1 that connects to publish (rankgate binds `127.0.0.1:port`).
async fn engine_publishing_to(port: u16) -> SimEngine {
    let dir = model::tiny_model_dir().unwrap();
    engine(SimConfig {
        kv_usage: vec![0.1],
        prefix_caching: true,
        kv_events: Some(KvEventsConfig {
            endpoint: KvEndpoint::Connect {
                host: "127.0.0.1".into(),
                port,
            },
            ..KvEventsConfig::bind_local()
        }),
        tokenizer: Some(model::tokenizer(&dir).unwrap()),
        ..sim(SimFlavor::Vllm, 1, 0)
    })
    .await
}

/// An engine that is its own DP deployment of one rank.
fn own(url: &str) -> String {
    format!("[[engines]]\nurl = \"{url}\"\nflavor = \"vllm\"\ndp_size = 1\n")
}

async fn refused_strangers(r: &rankgate::app::Router) -> f64 {
    let reply = get(r.admin_addr, "/metrics").await;
    let text = String::from_utf8_lossy(&reply.body).into_owned();
    (text.lines())
        .find(|l| l.starts_with("rankgate_kv_publishers_refused_total{reason=\"stranger\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(-1.0)
}

fn kv_of<'a>(rows: &'a [Value], worker: &str) -> &'a Value {
    &rows.iter().find(|w| w["id"] == worker).unwrap()["kv_index"]
}

#[tokio::test]
async fn a_strangers_publisher_changes_no_pick_and_no_rank() {
    let (pa, pb) = (free_port("127.0.0.1").await, free_port("127.0.0.1").await);
    let (a, b) = (
        engine_publishing_to(pa).await,
        engine_publishing_to(pb).await,
    );
    let dir = model::tiny_model_dir().unwrap();
    let extra = format!(
        "{FAST}[routing]\nprefix_affinity = true\nkv_events = true\n\
         [[models]]\nname = \"tiny-llama\"\ntokenizer = {:?}\n",
        dir.display().to_string()
    );
    let r = router(&extra, &[own(&a.url()), own(&b.url())]).await;
    wait_state(&r, &[0, 1], "available").await;
    // Both engines connected to their endpoints (messages published before are dropped, as a
    // ZeroMQ PUB drops them).
    until("both engines connected", WAIT, || {
        a.kv_event_subscribers() == [1] && b.kv_event_subscribers() == [1]
    })
    .await;
    let messages = json!([{"role": "user", "content": "Tell me about routers. ".repeat(60)}]);
    let body = json!({"model": "tiny-llama", "messages": messages, "max_tokens": 4});
    let first = post_json(r.addr, "/v1/chat/completions", body.clone()).await;
    assert_eq!(first.status, 200);
    let holder = first.worker();
    let rows = wait_workers(&r, WAIT, |rows| {
        kv_of(rows, &holder)["state"] == "available"
            && kv_of(rows, &holder)["blocks"].as_u64() > Some(0)
    })
    .await;
    let (other, other_port) = match holder == format!("{}@0", a.url()) {
        true => (format!("{}@0", b.url()), pb),
        false => (format!("{}@0", a.url()), pa),
    };
    let before = (kv_of(&rows, &holder).clone(), kv_of(&rows, &other).clone());

    // The stranger claims, on the other rank's endpoint, to be its engine starting afresh with
    // every block of the prompt (sequence 0); and on the holder's, connects and goes.
    let tokens = rankgate::tokenize::ChatTokenizer::from_dir(&dir)
        .unwrap()
        .chat(body.to_string().as_bytes())
        .unwrap()
        .ids;
    let block = before.0["block_size"].as_u64().unwrap() as usize;
    let claim = stores(&tokens, block);
    let to = |port| SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = connect_from("127.0.0.2", to(other_port)).await;
    let _ = s.write_all(&zmtp::greeting()).await;
    let _ = send(&mut s, 0, &claim).await;
    assert!(closed(&mut s).await);
    let mut s = connect_from("127.0.0.2", to(if other_port == pa { pb } else { pa })).await;
    assert!(closed(&mut s).await);
    drop(s);
    let deadline = tokio::time::Instant::now() + WAIT;
    while refused_strangers(&r).await < 2.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "strangers not counted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rows = workers(&r).await;
    assert_eq!(
        kv_of(&rows, &holder)["state"],
        "available",
        "the holder stays usable"
    );
    assert_eq!(kv_of(&rows, &holder)["messages"], before.0["messages"]);
    assert_eq!(kv_of(&rows, &other)["messages"], before.1["messages"]);
    assert_eq!(kv_of(&rows, &other)["state"], before.1["state"]);
    assert_eq!(kv_of(&rows, &other)["blocks"], before.1["blocks"]);
    // The next turn still goes where the engine holds the prompt.
    let again = post_json(r.addr, "/v1/chat/completions", body).await;
    assert_eq!(again.worker(), holder);
    r.shutdown().await;
}

/// A vLLM 0.32 payload storing `tokens`' full blocks of `block` tokens from the start.
fn stores(tokens: &[u32], block: usize) -> Vec<u8> {
    let n = tokens.len() / block;
    let hashes = (1..=n as u64).collect();
    let stored = KvEvent::stored(hashes, None, tokens[..n * block].to_vec(), block as u32);
    encode_batch(0.0, &[stored], 0)
}

#[tokio::test]
async fn a_hostile_kv_event_sources_answer_binds_nothing() {
    // 300 "ranks" on 127.0.0.2, an address that is not the engine's (127.0.0.1), from a port
    // found free.
    let base = free_port("127.0.0.2").await.min(65_535 - 300);
    let sources: serde_json::Map<String, Value> = (0..300u16)
        .map(|r| {
            let ep = format!("tcp://127.0.0.2:{}", base + r);
            let entry = json!({"endpoint": ep, "topic": "kv", "enable_kv_cache_events": true, "publisher": "zmq"});
            (r.to_string(), entry)
        })
        .collect();
    let answer = Value::Object(sources).to_string();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let answer = answer.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let (status, body) = match req.uri().path() {
                        "/kv_event_sources" => (StatusCode::OK, answer.clone()),
                        _ => (StatusCode::NOT_FOUND, "{}".to_string()),
                    };
                    let mut resp = Response::new(Full::new(Bytes::from(body)));
                    *resp.status_mut() = status;
                    async move { Ok::<_, Infallible>(resp) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            });
        }
    });
    let r = router(
        "[routing]\nprefix_affinity = true\nkv_events = true\n",
        &[engine_toml(&url, "vllm", 2, 0)],
    )
    .await;
    let rows = wait_workers(&r, WAIT, |rows| {
        rows.iter().all(|w| {
            (w["kv_index"]["reason"].as_str()).is_some_and(|s| {
                s.contains("/kv_event_sources refused: it lists 300 ranks, the engine has 2")
            })
        })
    })
    .await;
    assert_eq!(rows[0]["kv_index"]["state"], "unavailable");
    // Nothing of it was bound: the first of those ports is still free on 127.0.0.2.
    assert!(
        TcpListener::bind(("127.0.0.2", base)).await.is_ok(),
        "127.0.0.2:{base} was bound"
    );
    r.shutdown().await;
    server.abort();
}

#[tokio::test]
async fn a_ranks_feed_restarting_keeps_its_place_and_its_engine() {
    // The engine's entry is replaced (it reported its shape): the rank's new feed registers
    // before the old one's registration is dropped. The old one must not take the new route
    // with it, nor may the new one be refused as another engine's.
    let listeners = Listeners::default();
    let (addr, index, _old_writer, old) = endpoint(&listeners).await;
    let writer = feed::writer(&index);
    let engine: Arc<[IpAddr]> = ["127.0.0.1".parse().unwrap()].into();
    let new = listeners
        .register(addr, b"kv".to_vec(), 0, engine, &writer)
        .await;
    let _new = new.expect("the same rank's index registers again");
    drop(old);
    let mut s = publisher("127.0.0.1", addr).await;
    send(&mut s, 0, &payload()).await.unwrap();
    until("the engine's message applied", WAIT, || {
        index.counts.messages.load(Relaxed) == 1 && index.block_size().is_some()
    })
    .await;
    assert_eq!(listeners.refused().stranger.load(Relaxed), 0);
}

#[tokio::test]
async fn a_publisher_silent_past_the_stale_claim_gives_its_rank_to_the_engines_next() {
    // The engine's host rebooted without closing its connection: the old one stays open and
    // silent, the restarted engine connects from the same address.
    let listeners = Listeners::default();
    let (addr, index, _w, _reg) = endpoint(&listeners).await;
    let mut old = publisher("127.0.0.1", addr).await;
    send(&mut old, 0, &payload()).await.unwrap();
    until("the old publisher's message applied", WAIT, || {
        index.counts.messages.load(Relaxed) == 1
    })
    .await;
    // Its silence, without waiting for it.
    tokio::time::pause();
    tokio::time::advance(STALE_CLAIM + Duration::from_secs(1)).await;
    tokio::time::resume();
    let mut new = publisher("127.0.0.1", addr).await;
    send(&mut new, 0, &payload()).await.unwrap();
    assert!(closed(&mut old).await, "the silent publisher is closed");
    until("the new publisher's message applied", WAIT, || {
        index.counts.messages.load(Relaxed) == 2 && index.block_size().is_some()
    })
    .await;
    assert_eq!(listeners.refused().duplicate.load(Relaxed), 0);
}
