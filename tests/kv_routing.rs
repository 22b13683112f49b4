//! Exact prefix-cache routing end to end over real sockets: a simulated vLLM engine publishing
//! its KV-cache events (ZeroMQ, vLLM's framing) and tokenizing with the tiny model's real
//! tokenizer; rankgate routers subscribed to it (`routing.kv_events`, the same tokenizer in
//! `[[models]]`). Two replicas that share nothing send a conversation's turns, taken in turn,
//! to the rank its engine says holds it; a restart empties the engine's caches and the index
//! follows.

mod common;

use std::time::Duration;

use common::chat::{predicted, turn};
use common::*;
use rankgate_sim::sim::kv::KvEventsConfig;
use rankgate_sim::sim::prefix::text_token_ids;
use rankgate_sim::sim::{deployment, model, SimConfig, SimEngine, SimFlavor};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

async fn engine_with_events() -> SimEngine {
    let dir = model::tiny_model_dir().unwrap();
    engine(SimConfig {
        kv_usage: vec![0.1, 0.1],
        prefix_caching: true,
        kv_events: Some(KvEventsConfig::bind_local()),
        tokenizer: Some(model::tokenizer(&dir).unwrap()),
        ..sim(SimFlavor::Vllm, 2, 0)
    })
    .await
}

async fn exact_router(e: &SimEngine) -> rankgate::app::Router {
    let dir = model::tiny_model_dir().unwrap();
    let extra = format!(
        "{FAST}[routing]\nprefix_affinity = true\nkv_events = true\n\
         [[models]]\nname = \"tiny-llama\"\ntokenizer = {:?}\n",
        dir.display().to_string()
    );
    let r = router(&extra, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    wait_state(&r, &[0, 1], "available").await;
    r
}

#[tokio::test]
async fn replicas_sharing_nothing_follow_the_engines_own_cache() {
    let e = engine_with_events().await;
    let (a, b) = (exact_router(&e).await, exact_router(&e).await);
    let mut messages = vec![
        json!({"role": "system", "content": "You answer questions about inference routers. ".repeat(40)}),
    ];
    let mut workers = Vec::new();
    for t in 0..8 {
        messages.push(
            json!({"role": "user", "content": format!("question {t}: what about rank {t}?")}),
        );
        // The turns alternate between the replicas, as a plain L4 balancer spreads them.
        let r = if t % 2 == 0 { &a } else { &b };
        let (worker, answer) = turn(r, &messages, 4).await;
        messages.push(json!({"role": "assistant", "content": answer}));
        workers.push(worker);
        if t == 0 {
            // Both replicas' indexes learn the first turn's blocks from the engine itself (a
            // rank that has published nothing yet stays unavailable: rankgate cannot know what
            // it held before it subscribed).
            for r in [&a, &b] {
                wait_workers(r, WAIT, |rows| {
                    rows.iter().any(|w| {
                        w["id"] == workers[0].as_str()
                            && w["kv_index"]["state"] == "available"
                            && w["kv_index"]["blocks"].as_u64() > Some(0)
                    })
                })
                .await;
            }
        }
    }
    // Every turn after the first went where the engine holds the conversation, whichever
    // replica routed it (replica b never saw turn 0: only the events told it).
    assert!(workers[1..].iter().all(|w| *w == workers[0]), "{workers:?}");
    assert!(
        predicted(&b, "events").await > 0.0,
        "b's picks were made on the engine's word"
    );
    assert_eq!(predicted(&b, "record").await, 0.0);

    // The engine restarts: its caches are empty, its events start again at 0 with
    // AllBlocksCleared; the indexes follow (exact, holding nothing).
    e.restart();
    for r in [&a, &b] {
        wait_workers(r, WAIT, |rows| {
            rows.iter().all(|w| w["kv_index"]["blocks"] == 0)
                && rows.iter().any(|w| {
                    w["id"] == workers[0].as_str()
                        && w["kv_index"]["state"] == "available"
                        && w["kv_index"]["resets"].as_u64() >= Some(1)
                })
        })
        .await;
    }
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn without_a_publisher_a_rank_falls_back_to_the_record_and_says_why() {
    // Events on in the router, but this engine publishes none (no /kv_event_sources).
    let e = engine(SimConfig {
        kv_usage: vec![0.1, 0.1],
        ..sim(SimFlavor::Vllm, 2, 0)
    })
    .await;
    let r = exact_router(&e).await;
    let rows = wait_workers(&r, WAIT, |rows| {
        rows.iter().all(|w| {
            w["kv_index"]["reason"]
                .as_str()
                .is_some_and(|s| s.contains("/kv_event_sources"))
        })
    })
    .await;
    // No /kv_event_sources (an engine started without --kv-events-config): none will come.
    assert_eq!(rows[0]["kv_index"]["state"], "off");
    let messages = vec![json!({"role": "user", "content": "hello ".repeat(200)})];
    let (first, _) = turn(&r, &messages, 4).await;
    let (second, _) = turn(&r, &messages, 4).await;
    assert_eq!(
        first, second,
        "rankgate's record still keeps the prompt where it went"
    );
    assert!(predicted(&r, "record").await > 0.0);
    r.shutdown().await;
}

/// A completion of `prompt` pinned to rank 0 of `e`; one token out.
async fn complete(e: &SimEngine, prompt: &str) {
    let body = json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": 1});
    let r = send(
        post(e.addr, "/v1/completions")
            .header("x-data-parallel-rank", "0")
            .body(http_body_util::Full::new(body.to_string().into()))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

#[tokio::test]
async fn after_a_gap_of_100_events_the_replay_socket_makes_the_index_whole_again() {
    use rankgate::kv::{block_hashes, decode, feed, replay, zmtp::Subscriber, KvState, RankIndex};
    use std::sync::Arc;
    // The sim's text tokens: 4 bytes a token, 16 tokens a block; each prompt 3 blocks, unique
    // from its first block.
    let e = engine(SimConfig {
        prefix_caching: true,
        capacity_tokens: 1 << 20,
        decode_tokens_per_sec: 1e6,
        prefill_tokens_per_sec: 1e9,
        kv_events: Some(KvEventsConfig::bind_local_with_replay(10_000)),
        ..sim(SimFlavor::Vllm, 1, 0)
    })
    .await;
    let replay_at = e.kv_replay_addrs()[0].expect("a replay socket").to_string();
    let stream = tokio::net::TcpStream::connect(e.kv_event_addrs()[0].unwrap())
        .await
        .unwrap();
    let mut sub = Subscriber::start(stream, b"kv", 64 << 20).await.unwrap();
    until("subscribed", WAIT, || e.kv_event_subscribers()[0] == 1).await;
    // Never interrupted; interrupted with the replay socket; interrupted without it.
    let whole = feed::writer(&Arc::new(RankIndex::default()));
    let replayed = feed::writer(&Arc::new(RankIndex::default()));
    let lost = feed::writer(&Arc::new(RankIndex::default()));
    replayed.lock().unwrap().set_replay(Some(replay_at));
    let prompts: Vec<String> = (0..150)
        .map(|i| format!("{i:<64}").repeat(3) + "tail")
        .collect();
    for p in &prompts {
        complete(&e, p).await;
    }
    let index = |w: &feed::SharedWriter| w.lock().unwrap().index().clone();
    let (iw, ir, il) = (index(&whole), index(&replayed), index(&lost));
    let cached = e.cached_blocks()[0].len();
    assert!(cached >= 450, "{cached} blocks cached");
    // Every message, in order; messages 10..110 never reach two of the three.
    for _ in 0..10_000 {
        if iw.blocks() == cached {
            break;
        }
        let frames = tokio::time::timeout(WAIT, sub.recv())
            .await
            .unwrap()
            .unwrap();
        let m = decode(&frames).unwrap();
        replay::deliver(&whole, &m).await;
        if !(10..110).contains(&m.seq) {
            replay::deliver(&replayed, &m).await;
            replay::deliver(&lost, &m).await;
        }
    }
    assert_eq!(
        iw.blocks(),
        cached,
        "the uninterrupted index holds what the engine does"
    );
    let last = iw
        .counts
        .messages
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(last >= 120, "{last} messages: the gap is inside them");
    // The replay filled the gap: the same blocks, complete, exactly as the uninterrupted one.
    assert!(
        matches!(ir.state(), KvState::Available { partial: None, .. }),
        "{:?}",
        ir.state()
    );
    assert_eq!(
        ir.counts
            .replayed
            .load(std::sync::atomic::Ordering::Relaxed),
        100
    );
    assert_eq!(
        ir.counts.resets.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(ir.blocks(), iw.blocks());
    // Without it: a lower bound from the message after the gap, missing the gap's prompts.
    assert!(
        matches!(il.state(), KvState::Available { partial: Some(ref p), .. } if p.since == 110),
        "{:?}",
        il.state()
    );
    let (mut held_whole, mut held_lost) = (0, 0);
    for p in &prompts {
        let names = block_hashes(&text_token_ids(p.as_bytes()), 16);
        let w = iw.matched_blocks(&names);
        assert_eq!(ir.matched_blocks(&names), w, "{p:?}");
        assert!(
            il.matched_blocks(&names) <= w,
            "never more than the engine holds"
        );
        held_whole += w;
        held_lost += il.matched_blocks(&names);
    }
    assert_eq!(held_whole, 450);
    assert!(
        held_lost < held_whole,
        "the gap's prompts are missing: {held_lost}"
    );
}

/// Per local rank, the blocks a router's index holds for `e`'s ranks (from `/workers`).
fn index_blocks(rows: &[serde_json::Value], rank: u32) -> Option<u64> {
    let row = rows.iter().find(|w| {
        w["id"]
            .as_str()
            .is_some_and(|id| id.ends_with(&format!("@{rank}")))
    })?;
    row["kv_index"]["blocks"].as_u64()
}

#[tokio::test]
async fn a_restarted_router_predicts_what_the_engine_stored_since_at_once() {
    let dir = model::tiny_model_dir().unwrap();
    // The default simulator's capacity: a rank holds 27,557 blocks, hours of traffic to fill.
    let e = engine(SimConfig {
        kv_usage: vec![0.1, 0.1],
        prefix_caching: true,
        capacity_tokens: deployment::CAPACITY_TOKENS,
        kv_events: Some(KvEventsConfig::bind_local()),
        tokenizer: Some(model::tokenizer(&dir).unwrap()),
        ..sim(SimFlavor::Vllm, 2, 0)
    })
    .await;
    let chat = |tag: &str| {
        vec![
            json!({"role": "user", "content": format!("{tag} asks: {}", "tell me about routers and caches. ".repeat(12))}),
        ]
    };
    // The workload before the router restarts, and while it is down (straight to the engine).
    let a = exact_router(&e).await;
    for c in 0..4 {
        let (_, answer) = turn(&a, &chat(&format!("before-{c}")), 4).await;
        assert!(answer.is_string());
    }
    a.shutdown().await;
    for c in 0..2 {
        let body =
            json!({"model": "tiny-llama", "messages": chat(&format!("down-{c}")), "max_tokens": 4});
        assert_eq!(
            post_json(e.addr, "/v1/chat/completions", body).await.status,
            200
        );
    }
    // Restarted: it joins the engine's events mid-sequence, with no replay socket.
    let restarted = tokio::time::Instant::now();
    let b = exact_router(&e).await;
    let held_before: Vec<usize> = e.cached_blocks().iter().map(Vec::len).collect();
    let hits = |e: &SimEngine| e.prefix_cache().iter().map(|c| c.1).sum::<u64>();
    let (engine_before, predicted_before) = (hits(&e), predicted(&b, "events").await);
    for c in 0..4 {
        let mut messages = chat(&format!("after-{c}"));
        for t in 0..3 {
            let (_, answer) = turn(&b, &messages, 4).await;
            messages.push(json!({"role": "assistant", "content": answer}));
            messages.push(json!({"role": "user", "content": format!("and turn {t}?")}));
            // The index has applied what this turn stored (all of it is since the restart).
            wait_workers(&b, WAIT, |rows| {
                (0..2).all(|r| {
                    let since = e.cached_blocks()[r].len() - held_before[r];
                    index_blocks(rows, r as u32) == Some(since as u64)
                })
            })
            .await;
        }
    }
    let engine_hits = hits(&e) - engine_before;
    let predicted_hits = predicted(&b, "events").await - predicted_before;
    assert!(engine_hits > 0, "later turns hit the engine's cache");
    assert_eq!(
        predicted_hits, engine_hits as f64,
        "the partial index predicts exactly what the engine found"
    );
    assert!(restarted.elapsed() < Duration::from_secs(30));
    // A rank whose events it joined late says so; one that published nothing before the
    // restart was seen from its first message: complete. One that published nothing since the
    // restart (the turns all went to the other) has no coverage to tell yet.
    let rows = wait_workers(&b, WAIT, |_| true).await;
    let coverage: Vec<&str> = (rows.iter())
        .map(|w| w["kv_index"]["coverage"].as_str().unwrap_or_default())
        .collect();
    let silent_since = |r: usize| e.cached_blocks()[r].len() == held_before[r];
    assert!(
        coverage.iter().any(|c| c.starts_with("partial since "))
            && coverage.iter().enumerate().all(|(r, c)| {
                c.starts_with("partial since ")
                    || *c == "complete"
                    || (c.is_empty() && silent_since(r))
            }),
        "{coverage:?}"
    );
    b.shutdown().await;
}
