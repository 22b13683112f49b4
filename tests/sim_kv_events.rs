//! The simulated engine's KV-cache events over real TCP on 127.0.0.1: a ZMTP subscriber gets,
//! per rank, vLLM-framed batches whose `BlockStored` token ids and chaining are what the rank
//! cached, `BlockRemoved` for evictions, a sequence restarting at 0 with `AllBlocksCleared` after
//! a restart (and going on after a prefix-cache reset), both connection directions, `GET /kv_event_sources`, and a stalled or late
//! subscriber that never slows requests. Every wait is bounded in count and time.
#![cfg(feature = "sim")] // the simulated engine

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use common::{engine, get, post, send, sim};
use http_body_util::Full;
use rankgate_sim::sim::kv::zmtp::Subscriber;
use rankgate_sim::sim::kv::{KvEndpoint, KvEventsConfig};
use rankgate_sim::sim::prefix::text_token_ids;
use rankgate_sim::sim::{SimConfig, SimEngine, SimFlavor};
use serde_json::{json, Value};
use tokio::net::TcpStream;

const WAIT: Duration = Duration::from_secs(10);

fn with_events(dp: u32, capacity: u64, events: KvEventsConfig) -> SimConfig {
    SimConfig {
        prefix_caching: true,
        capacity_tokens: capacity,
        // Instant engine: these tests are about events, not timing.
        decode_tokens_per_sec: 1e6,
        prefill_tokens_per_sec: 1e9,
        kv_events: Some(events),
        ..sim(SimFlavor::Vllm, dp, 0)
    }
}

/// A completion of `prompt` pinned to `rank`; two tokens out.
async fn complete(addr: SocketAddr, prompt: &str, rank: u32) {
    let body = json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": 2});
    let r = send(
        post(addr, "/v1/completions")
            .header("x-data-parallel-rank", rank.to_string())
            .body(Full::new(body.to_string().into()))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

/// A SUB on `addr` subscribed to "kv", returned once the engine counts it on local rank `rank`.
async fn subscribe(e: &SimEngine, rank: usize) -> Subscriber<TcpStream> {
    let addr = e.kv_event_addrs()[rank].expect("bound");
    let before = e.kv_event_subscribers()[rank];
    let stream = TcpStream::connect(addr).await.expect("connect");
    let sub = Subscriber::start(stream, b"kv", 64 << 20)
        .await
        .expect("handshake");
    subscribed(e, rank, before + 1).await;
    sub
}

/// Waits (bounded) until local rank `rank` counts `n` subscribers.
async fn subscribed(e: &SimEngine, rank: usize, n: usize) {
    for _ in 0..2000 {
        if e.kv_event_subscribers()[rank] >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("subscription not seen: {:?}", e.kv_event_subscribers());
}

/// One message: (sequence number, events, data_parallel_rank).
async fn recv(sub: &mut Subscriber<TcpStream>) -> (u64, Vec<Value>, u64) {
    let parts = tokio::time::timeout(WAIT, sub.recv())
        .await
        .expect("a message in time")
        .expect("a message");
    assert_eq!(parts.len(), 3, "topic, sequence, payload");
    assert_eq!(parts[0], b"kv");
    let seq = u64::from_be_bytes(parts[1][..].try_into().expect("8-byte sequence"));
    let (payload, rest) = decode(&parts[2]);
    assert!(rest.is_empty(), "one msgpack value");
    let batch = payload.as_array().expect("batch array");
    assert_eq!(batch.len(), 3);
    assert!(batch[0].as_f64().expect("ts") > 1.7e9);
    let events = batch[1].as_array().expect("events").clone();
    (seq, events, batch[2].as_u64().expect("rank"))
}

/// A small msgpack reader (the forms the engine writes), to check the sim from outside.
fn decode(b: &[u8]) -> (Value, &[u8]) {
    let (tag, b) = (b[0], &b[1..]);
    match tag {
        0x00..=0x7f => (json!(tag), b),
        0x80..=0x8f => many(usize::from(tag & 0x0f), b, true),
        0x90..=0x9f => many(usize::from(tag & 0x0f), b, false),
        0xa0..=0xbf => text(usize::from(tag & 0x1f), b),
        0xc0 => (Value::Null, b),
        0xcb => (json!(f64::from_bits(be(8, b))), &b[8..]),
        0xcc => (json!(be(1, b)), &b[1..]),
        0xcd => (json!(be(2, b)), &b[2..]),
        0xce => (json!(be(4, b)), &b[4..]),
        0xcf => (json!(be(8, b)), &b[8..]),
        0xd9 => text(be(1, b) as usize, &b[1..]),
        0xdc => many(be(2, b) as usize, &b[2..], false),
        0xdd => many(be(4, b) as usize, &b[4..], false),
        0xde => many(be(2, b) as usize, &b[2..], true),
        other => panic!("unexpected msgpack tag {other:#x}"),
    }
}

fn be(n: usize, b: &[u8]) -> u64 {
    b[..n].iter().fold(0u64, |a, &x| a << 8 | u64::from(x))
}

fn text(n: usize, b: &[u8]) -> (Value, &[u8]) {
    let s = std::str::from_utf8(&b[..n]).expect("utf-8").to_string();
    (Value::String(s), &b[n..])
}

/// `n` array elements, or `n` map pairs.
fn many(n: usize, mut b: &[u8], pairs: bool) -> (Value, &[u8]) {
    let mut arr = Vec::new();
    let mut map = serde_json::Map::new();
    for _ in 0..n {
        let (v, r) = decode(b);
        if pairs {
            let (w, r2) = decode(r);
            map.insert(v.as_str().expect("str key").to_string(), w);
            b = r2;
        } else {
            arr.push(v);
            b = r;
        }
    }
    let v = if pairs {
        Value::Object(map)
    } else {
        Value::Array(arr)
    };
    (v, b)
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("list")
        .iter()
        .map(|x| x.as_u64().expect("u64"))
        .collect()
}

/// Applies events to a subscriber's view of one rank's cache.
fn apply(index: &mut BTreeSet<u64>, events: &[Value]) {
    for e in events {
        match e["type"].as_str() {
            Some("BlockStored") => index.extend(u64s(&e["block_hashes"])),
            Some("BlockRemoved") => {
                for h in u64s(&e["block_hashes"]) {
                    index.remove(&h);
                }
            }
            Some("AllBlocksCleared") => index.clear(),
            other => panic!("unknown event {other:?}"),
        }
    }
}

/// A prompt of `blocks` full 16-token blocks (64 bytes each) plus a short tail, unique by `tag`.
fn prompt(tag: &str, blocks: usize) -> String {
    let mut p = format!("{tag:<8}");
    while p.len() < blocks * 64 {
        p.push_str("lorem ipsum dolor sit amet ");
    }
    p.truncate(blocks * 64);
    p.push_str("tail");
    p
}

#[tokio::test]
async fn a_prompt_is_published_by_its_rank_with_its_token_ids_and_chain() {
    let e = engine(with_events(2, 4096, KvEventsConfig::bind_local())).await;
    let mut r0 = subscribe(&e, 0).await;
    let mut r1 = subscribe(&e, 1).await;

    let first = prompt("convA", 3);
    complete(e.addr, &first, 1).await;
    let (seq, events, rank) = recv(&mut r1).await;
    assert_eq!((seq, rank), (0, 1), "rank 1's first batch, numbered from 0");
    assert_eq!(events.len(), 1, "{events:?}");
    let stored = &events[0];
    assert_eq!(stored["type"], "BlockStored");
    assert_eq!(stored["parent_block_hash"], Value::Null);
    assert_eq!(stored["block_size"], 16);
    assert_eq!(stored["medium"], "GPU");
    let hashes = u64s(&stored["block_hashes"]);
    assert_eq!(
        hashes.len(),
        3,
        "three whole blocks, the tail is not cached"
    );
    // Without a tokenizer a token is 4 bytes of text, read as a little-endian u32.
    let want: Vec<u64> = text_token_ids(&first.as_bytes()[..3 * 64])
        .into_iter()
        .map(u64::from)
        .collect();
    assert_eq!(u64s(&stored["token_ids"]), want);
    let cached: BTreeSet<u64> = e.cached_blocks()[1].iter().copied().collect();
    assert_eq!(cached, hashes.iter().copied().collect());

    // The same conversation, longer: only the new blocks, chained to the last cached one.
    let second = format!("{}{}", &first[..3 * 64], prompt("more", 2));
    complete(e.addr, &second, 1).await;
    let (seq, events, _) = recv(&mut r1).await;
    assert_eq!(seq, 1);
    assert_eq!(events[0]["parent_block_hash"], json!(hashes[2]));
    assert_eq!(u64s(&events[0]["block_hashes"]).len(), 2);

    // Rank 0 numbers its own batches.
    complete(e.addr, &prompt("convB", 1), 0).await;
    let (seq, events, rank) = recv(&mut r0).await;
    assert_eq!((seq, rank, events.len()), (0, 0, 1));
    e.shutdown().await;
}

#[tokio::test]
async fn evictions_are_published_and_the_subscribers_view_matches_the_cache() {
    // Room for 8 blocks: three 4-block prompts cannot all stay.
    let e = engine(with_events(1, 128, KvEventsConfig::bind_local())).await;
    let mut sub = subscribe(&e, 0).await;
    for tag in ["one", "two", "three"] {
        complete(e.addr, &prompt(tag, 4), 0).await;
    }
    let truth: BTreeSet<u64> = e.cached_blocks()[0].iter().copied().collect();
    let mut index = BTreeSet::new();
    let (mut removed, mut next) = (0, 0);
    for _ in 0..100 {
        let (seq, events, _) = recv(&mut sub).await;
        assert_eq!(seq, next, "no gap");
        next += 1;
        removed += events
            .iter()
            .filter(|e| e["type"] == "BlockRemoved")
            .count();
        apply(&mut index, &events);
        if index == truth {
            break;
        }
    }
    assert_eq!(index, truth, "stores minus removals is what the rank holds");
    assert!(removed >= 4, "{removed} removals");
    e.shutdown().await;
}

#[tokio::test]
async fn a_restart_starts_the_sequence_again_with_all_blocks_cleared() {
    let e = engine(with_events(1, 4096, KvEventsConfig::bind_local())).await;
    let mut sub = subscribe(&e, 0).await;
    let p = prompt("again", 2);
    complete(e.addr, &p, 0).await;
    let (s0, first, _) = recv(&mut sub).await;
    complete(e.addr, &prompt("other", 2), 0).await;
    let (s1, _, _) = recv(&mut sub).await;
    assert_eq!((s0, s1), (0, 1));

    e.restart_rank(0);
    let (seq, events, _) = recv(&mut sub).await;
    assert_eq!(seq, 0, "a restarted engine numbers from 0 again");
    assert_eq!(events, vec![json!({"type": "AllBlocksCleared"})]);
    assert!(e.cached_blocks()[0].is_empty());

    // The same prompt is stored again, from scratch.
    complete(e.addr, &p, 0).await;
    let (seq, events, _) = recv(&mut sub).await;
    assert_eq!(seq, 1);
    assert_eq!(events[0]["block_hashes"], first[0]["block_hashes"]);
    assert_eq!(events[0]["parent_block_hash"], Value::Null);

    // vLLM's reset_prefix_cache: cleared too, but the numbering goes on.
    assert_eq!(e.reset_prefix_cache(), [true]);
    let (seq, events, _) = recv(&mut sub).await;
    assert_eq!(seq, 2);
    assert_eq!(events, vec![json!({"type": "AllBlocksCleared"})]);
    e.shutdown().await;
}

#[tokio::test]
async fn the_engine_connects_to_a_subscriber_that_binds() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let cfg = KvEventsConfig {
        endpoint: KvEndpoint::Connect {
            host: "127.0.0.1".into(),
            port,
        },
        ..KvEventsConfig::bind_local()
    };
    // One rank: rank r dials port + r, and only this port is known to be ours.
    let e = engine(with_events(1, 4096, cfg)).await;
    assert_eq!(e.kv_event_endpoints(), [format!("tcp://127.0.0.1:{port}")]);
    let (stream, _) = tokio::time::timeout(WAIT, listener.accept())
        .await
        .expect("the engine dials in time")
        .unwrap();
    let mut sub = Subscriber::start(stream, b"", 1 << 20).await.unwrap();
    subscribed(&e, 0, 1).await;
    complete(e.addr, &prompt("dialled", 1), 0).await;
    let (seq, events, _) = recv(&mut sub).await;
    assert_eq!((seq, events[0]["type"].as_str()), (0, Some("BlockStored")));
    e.shutdown().await;
}

#[tokio::test]
async fn kv_event_sources_lists_each_ranks_endpoint_like_vllm() {
    let e = engine(with_events(2, 4096, KvEventsConfig::bind_local())).await;
    let got = get(e.addr, "/kv_event_sources").await.json();
    let fixture: Value = serde_json::from_str(include_str!(
        "fixtures/vllm-0.32-kv-events/kv_event_sources.json"
    ))
    .unwrap();
    for (rank, addr) in e.kv_event_addrs().iter().enumerate() {
        let mine = &got[rank.to_string()];
        let real = &fixture[rank.to_string()];
        let keys = |v: &Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
        assert_eq!(keys(mine), keys(real), "the same fields as vLLM's");
        let port = addr.expect("bound").port();
        assert_eq!(mine["endpoint"], format!("tcp://*:{port}"));
        assert_eq!(mine["topic"], "kv");
        assert_eq!(mine["replay_endpoint"], Value::Null);
    }
    // Without events the route is not there, as before.
    let plain = engine(sim(SimFlavor::Vllm, 2, 0)).await;
    assert_eq!(get(plain.addr, "/kv_event_sources").await.status, 404);
    e.shutdown().await;
}

#[tokio::test]
async fn a_stalled_or_late_subscriber_never_slows_requests() {
    // A queue of 4 messages per subscriber, and big messages (16k-token prompts, about 80 KB of
    // events each, 25 MB in all) so that the stalled subscriber's socket buffers fill and its
    // queue overflows.
    let cfg = KvEventsConfig {
        hwm: 4,
        ..KvEventsConfig::bind_local()
    };
    let e = engine(with_events(1, 1 << 20, cfg)).await;
    let mut stalled = subscribe(&e, 0).await;
    let started = tokio::time::Instant::now();
    let n = 300;
    for i in 0..n {
        complete(e.addr, &prompt(&format!("s{i}"), 1024), 0).await;
    }
    let took = started.elapsed();
    assert!(took < Duration::from_secs(30), "{n} requests took {took:?}");
    assert!(
        e.kv_events_dropped()[0] > 0,
        "the stalled subscriber's queue overflowed"
    );

    // A late subscriber starts wherever the numbering is.
    let mut late = subscribe(&e, 0).await;
    complete(e.addr, &prompt("marker", 1), 0).await;
    let (newest, events, _) = recv(&mut late).await;
    assert!(
        newest > 0,
        "numbering goes on, it does not start again for a newcomer"
    );
    assert_eq!(u64s(&events[0]["block_hashes"]).len(), 1);

    // The stalled one, read at last, sees the gap its dropped messages left.
    let (mut last, mut gap) = (None, false);
    for _ in 0..=newest {
        let (seq, _, _) = recv(&mut stalled).await;
        gap |= last.is_some_and(|l: u64| seq != l + 1);
        last = Some(seq);
        if seq == newest {
            break;
        }
    }
    assert_eq!(last, Some(newest), "it catches up with the newest message");
    assert!(gap, "dropped messages show as a gap in the sequence");
    e.shutdown().await;
}

#[tokio::test]
async fn a_tokenizer_names_the_blocks_and_an_answer_is_kept_after_its_prompt() {
    // A stand-in tokenizer: one token per character, its code point as the id.
    let chars = |s: &str| s.chars().map(u32::from).collect::<Vec<u32>>();
    let tokenizer = rankgate_sim::sim::SimTokenizer::new(
        move |body: &Value| body["prompt"].as_str().map(chars),
        move |text: &str| Some(chars(text)),
    );
    let cfg = SimConfig {
        tokenizer: Some(tokenizer),
        ..with_events(1, 4096, KvEventsConfig::bind_local())
    };
    let e = engine(cfg).await;
    let mut sub = subscribe(&e, 0).await;
    let prompt = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMN"; // 40 tokens: 2 whole blocks
    let body = json!({"prompt": prompt, "max_tokens": 10});
    let r = send(
        post(e.addr, "/v1/completions")
            .body(Full::new(body.to_string().into()))
            .unwrap(),
    )
    .await;
    let answer = r.json();
    assert_eq!(
        answer["usage"]["prompt_tokens"], 40,
        "the tokenizer's count"
    );
    let text = answer["choices"][0]["text"].as_str().unwrap().to_string();

    let ids: Vec<u64> = chars(prompt).into_iter().map(u64::from).collect();
    // The prompt's blocks at admission, the answer's at the end: one batch or two, depending
    // on when the publisher woke.
    let mut stored = Vec::new();
    for _ in 0..2 {
        let (_, events, _) = recv(&mut sub).await;
        stored.extend(events);
        if stored.len() >= 2 {
            break;
        }
    }
    assert_eq!(stored.len(), 2, "{stored:?}");
    assert_eq!(u64s(&stored[0]["token_ids"]), ids[..32]);
    let prompt_blocks = u64s(&stored[0]["block_hashes"]);
    // The answer's 30 tokens follow the prompt's 40: blocks 2 and 3 join the cache, chained to
    // the prompt's last block.
    let mut all: Vec<u64> = ids.clone();
    all.extend(chars(&text).into_iter().map(u64::from));
    assert_eq!(stored[1]["parent_block_hash"], json!(prompt_blocks[1]));
    assert_eq!(u64s(&stored[1]["token_ids"]), all[32..64]);
    assert_eq!(e.cached_blocks()[0].len(), 4);
    e.shutdown().await;
}

#[tokio::test]
async fn a_garbage_peer_is_dropped_and_others_are_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let e = engine(with_events(1, 4096, KvEventsConfig::bind_local())).await;
    let addr = e.kv_event_addrs()[0].unwrap();
    let mut junk = TcpStream::connect(addr).await.unwrap();
    junk.write_all(&[0x42; 64]).await.unwrap();
    // The engine hangs up on it: reads end (after its own greeting and READY).
    let mut buf = vec![0; 1024];
    let closed = tokio::time::timeout(WAIT, async {
        for _ in 0..100 {
            match junk.read(&mut buf).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => {}
            }
        }
        false
    })
    .await
    .expect("closed in time");
    assert!(closed);
    let mut sub = subscribe(&e, 0).await;
    complete(e.addr, &prompt("fine", 1), 0).await;
    let (seq, _, _) = recv(&mut sub).await;
    assert_eq!(seq, 0);
    e.shutdown().await;
}
