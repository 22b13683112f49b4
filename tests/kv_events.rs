//! The KV-event subscriber over real TCP on 127.0.0.1: a test publisher speaks ZMTP as a PUB
//! and replays every frame a real vLLM 0.32 DP=2 engine published
//! (`tests/fixtures/vllm-0.32-kv-events/events-dp2.jsonl`), then misbehaves: a sequence gap,
//! garbage, a 100 MB frame header, a restart, going away. Each rank's index must say so, the
//! other rank must not notice, and nothing may grow without bound.

mod common;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use rankgate::kv::feed::{self, SharedWriter};
use rankgate::kv::listen::Listeners;
use rankgate::kv::zmtp::{self, read_frame, sub_request, SubRequest};
use rankgate::kv::{block_hashes, KvState, RankIndex};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

const CAPTURE: &str = include_str!("fixtures/vllm-0.32-kv-events/events-dp2.jsonl");
const WAIT: Duration = Duration::from_secs(10);

/// Each captured message: the rank that sent it, its frames, its decoded JSON.
fn capture() -> Vec<(u32, Vec<Vec<u8>>, serde_json::Value)> {
    (rankgate::kv::capture::read(CAPTURE).unwrap().into_iter())
        .map(|r| (r.rank, r.frames, r.line))
        .collect()
}

/// A publisher that binds (the engine with `tcp://*:PORT`): accepts one subscriber, completes
/// the handshake and waits for its subscription.
struct Publisher {
    stream: TcpStream,
}

impl Publisher {
    async fn accept(listener: &TcpListener) -> Publisher {
        let (mut stream, _) = listener.accept().await.unwrap();
        zmtp::handshake(&mut stream, "PUB", &["SUB", "XSUB"])
            .await
            .unwrap();
        let f = read_frame(&mut stream, 1024).await.unwrap();
        assert_eq!(sub_request(f), SubRequest::Subscribe(b"kv".to_vec()));
        Publisher { stream }
    }

    async fn send(&mut self, frames: &[Vec<u8>]) {
        let parts: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        self.stream.write_all(&zmtp::message(&parts)).await.unwrap();
    }

    /// A message whose sequence number is `seq` and whose payload is the capture's `payload`.
    async fn send_seq(&mut self, seq: u64, payload: &[u8]) {
        self.send(&[b"kv".to_vec(), seq.to_be_bytes().to_vec(), payload.to_vec()])
            .await;
    }
}

fn subscriber(
    addr: std::net::SocketAddr,
) -> (Arc<RankIndex>, SharedWriter, tokio::task::JoinHandle<()>) {
    let index = Arc::new(RankIndex::default());
    let writer = feed::writer(&index);
    let task = tokio::spawn(feed::connect_rank(
        addr.to_string(),
        b"kv".to_vec(),
        writer.clone(),
    ));
    (index, writer, task)
}

/// The engine's address on the tests' bound endpoints.
fn local() -> Arc<[std::net::IpAddr]> {
    [std::net::IpAddr::from([127, 0, 0, 1])].into()
}

fn unavailable_because(index: &RankIndex, says: &str) -> bool {
    matches!(index.state(), KvState::Unavailable { reason } if reason.contains(says))
}

/// Used by picks as a lower bound (joined late, lost events), for a reason saying `says`.
fn partial_because(index: &RankIndex, says: &str) -> bool {
    matches!(index.state(), KvState::Available { partial: Some(p), .. } if p.why.contains(says))
}

/// Names of every block the engine holds after the capture, per rank, from the decoded JSON.
fn held_names(rank: u32) -> Vec<Vec<u64>> {
    let mut chains = Vec::new();
    for (r, _, line) in capture() {
        if r != rank {
            continue;
        }
        for e in line["decoded"][1].as_array().unwrap() {
            if e["type"] == "BlockStored" && e["parent_block_hash"].is_null() {
                let tokens: Vec<u32> = serde_json::from_value(e["token_ids"].clone()).unwrap();
                chains.push(block_hashes(&tokens, 128));
            }
        }
    }
    chains
}

#[tokio::test]
async fn a_replayed_capture_builds_each_ranks_index_and_faults_touch_only_their_rank() {
    let (l0, l1) = (
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
    );
    let (i0, _w0, t0) = subscriber(l0.local_addr().unwrap());
    let (i1, _w1, t1) = subscriber(l1.local_addr().unwrap());
    let (mut p0, mut p1) = (Publisher::accept(&l0).await, Publisher::accept(&l1).await);
    // The engine's first messages (sequence 0..2) predate the capture: rankgate joins late.
    let msgs = capture();
    let payload0 = msgs.iter().find(|m| m.0 == 0).unwrap().1[2].clone();
    p0.send_seq(0, &payload0).await;
    let mut last = [0u64; 2];
    for (rank, frames, line) in &msgs {
        let seq = line["seq"].as_u64().unwrap();
        // Renumbered from 1 so that the replay is one unbroken sequence from 0 on rank 0.
        let seq = if *rank == 0 { seq - 2 } else { seq };
        let p = if *rank == 0 { &mut p0 } else { &mut p1 };
        p.send_seq(seq, &frames[2]).await;
        last[*rank as usize] = seq;
    }
    let (n0, n1) = (
        msgs.iter().filter(|m| m.0 == 0).count() as u64 + 1,
        msgs.iter().filter(|m| m.0 == 1).count() as u64,
    );
    common::until("every message applied", WAIT, || {
        i0.counts.messages.load(Relaxed) == n0 && i1.counts.messages.load(Relaxed) == n1
    })
    .await;
    // Rank 0 saw its sequence from 0: exact. Rank 1 joined at 3: a lower bound, used.
    assert!(
        matches!(
            i0.state(),
            KvState::Available {
                block_size: 128,
                ..
            }
        ),
        "{:?}",
        i0.state()
    );
    assert!(
        partial_because(&i1, "joined the engine's events at sequence 3"),
        "{:?}",
        i1.state()
    );
    assert!(matches!(
        i0.state(),
        KvState::Available { partial: None, .. }
    ));
    assert_eq!(i0.block_size(), Some(128));
    assert_eq!(i1.block_size(), Some(128));
    // Each conversation's first blocks: rank 1's chat is held by rank 1 only (its index still
    // holds what it saw), rank 0 evicted the oldest of its own.
    let chains1 = held_names(1);
    assert!(i1.matched_blocks(&chains1[0]) >= 1);
    assert_eq!(
        i0.matched_blocks(&chains1[0]),
        0,
        "rank 0 never held rank 1's chat"
    );
    let held0 = i0.blocks();
    assert!(
        held0 > 0 && held0 <= 32,
        "bounded by the rank's 4096 tokens of KV: {held0}"
    );

    // A gap on rank 0 (no replay socket): cleared to a lower bound; rank 1 untouched.
    let blocks1 = i1.blocks();
    p0.send_seq(last[0] + 5, &payload0).await;
    common::until("the gap seen", WAIT, || {
        partial_because(&i0, "missed events")
    })
    .await;
    assert_eq!(i1.blocks(), blocks1);

    // Garbage: an undecodable payload drops the index as a gap does.
    p0.send_seq(last[0] + 6, b"\xc1 not msgpack").await;
    common::until("the garbage seen", WAIT, || {
        partial_because(&i0, "undecodable")
    })
    .await;

    // A restart (sequence back to 0): exact again from its first message.
    p0.send_seq(0, &payload0).await;
    common::until("exact after the restart", WAIT, || {
        matches!(
            i0.state(),
            KvState::Available {
                partial: None,
                block_size: 128,
                ..
            }
        )
    })
    .await;
    assert_eq!(
        i0.blocks(),
        3,
        "only what the restarted engine stored since"
    );

    // A 100 MB frame: refused from its header (never allocated), the connection dropped, the
    // rank unavailable; the subscriber reconnects.
    let mut huge = vec![0x02u8];
    huge.extend_from_slice(&(100u64 << 20).to_be_bytes());
    p0.stream.write_all(&huge).await.unwrap();
    common::until("the huge frame refused", WAIT, || {
        unavailable_because(&i0, "over the")
    })
    .await;
    let mut p0 = Publisher::accept(&l0).await;
    // Nothing was missed meanwhile on the reconnect (sequence follows on): usable again.
    p0.send_seq(1, &payload0).await;
    common::until("usable after the reconnect", WAIT, || {
        i0.block_size() == Some(128)
    })
    .await;

    // The publisher goes away: unavailable, not cleared, until its next message.
    drop(p0);
    common::until("the publisher's loss seen", WAIT, || {
        unavailable_because(&i0, "publisher")
    })
    .await;
    assert!(i0.blocks() > 0);
    assert_eq!(i1.blocks(), blocks1, "the other rank never noticed");
    t0.abort();
    t1.abort();
    let _ = p1.stream.shutdown().await;
}

#[tokio::test]
async fn engines_that_connect_are_told_apart_by_topic_and_rank() {
    // rankgate binds; two "engines" connect and publish rank 0 on their own topics.
    let port = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let listeners = Listeners::default();
    let (a, b) = (
        Arc::new(RankIndex::default()),
        Arc::new(RankIndex::default()),
    );
    let (wa, wb) = (feed::writer(&a), feed::writer(&b));
    let _ra = listeners
        .register(port, b"a".to_vec(), 0, local(), &wa)
        .await
        .unwrap();
    let _rb = listeners
        .register(port, b"b".to_vec(), 0, local(), &wb)
        .await
        .unwrap();
    let dup = listeners
        .register(
            port,
            b"a".to_vec(),
            0,
            local(),
            &feed::writer(&Arc::new(RankIndex::default())),
        )
        .await;
    assert!(dup
        .err()
        .unwrap()
        .contains("give each engine its own topic"));
    let payload = capture()[0].1[2].clone();
    for topic in [b"a", b"b"] {
        let mut s = TcpStream::connect(port).await.unwrap();
        zmtp::handshake(&mut s, "PUB", &["SUB"]).await.unwrap();
        let _subscription = read_frame(&mut s, 1024).await.unwrap();
        let frames: [&[u8]; 3] = [topic, &0u64.to_be_bytes(), &payload];
        s.write_all(&zmtp::message(&frames)).await.unwrap();
        let index = if topic == b"a" { &a } else { &b };
        common::until("the engine's message routed", WAIT, || {
            index.counts.messages.load(Relaxed) == 1
        })
        .await;
    }
    assert_eq!((a.blocks(), b.blocks()), (3, 3));
}
