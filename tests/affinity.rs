//! Prefix-cache affinity over real sockets: a conversation's turns stay on the rank holding its
//! earlier turns while load allows, and spread by load when affinity is off.

mod common;

use bytes::Bytes;
use common::*;
use http_body_util::Full;
use rankgate_sim::sim::{SimConfig, SimFlavor};
use serde_json::{json, Value};

/// `turns` chat turns of one conversation (a long system prompt, then each turn's question and
/// the answer it got), sent one after the other; returns the worker of each.
async fn conversation(r: &rankgate::app::Router, turns: usize) -> Vec<String> {
    let mut messages = vec![
        json!({"role": "system", "content": "You answer questions about inference. ".repeat(30)}),
    ];
    let mut workers = Vec::new();
    for t in 0..turns {
        messages.push(
            json!({"role": "user", "content": format!("question {t}: what about rank {t}?")}),
        );
        let body = json!({"model": "tiny-llama", "messages": messages, "max_tokens": 2});
        let reply = send(
            post(r.addr, "/v1/chat/completions")
                .body(Full::new(Bytes::from(body.to_string())))
                .unwrap(),
        )
        .await;
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        let answer: Value = reply.json()["choices"][0]["message"]["content"].clone();
        messages.push(json!({"role": "assistant", "content": answer}));
        workers.push(reply.worker());
    }
    workers
}

async fn two_equal_ranks(routing: &str) -> (rankgate_sim::sim::SimEngine, rankgate::app::Router) {
    let e = engine(SimConfig {
        kv_usage: vec![0.1, 0.1],
        ..sim(SimFlavor::Vllm, 2, 0)
    })
    .await;
    let r = router(
        &format!("{FAST}[routing]\n{routing}"),
        &[engine_toml(&e.url(), "vllm", 2, 0)],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    (e, r)
}

#[tokio::test]
async fn a_conversation_stays_on_the_rank_holding_its_prefix() {
    let (_e, r) = two_equal_ranks("prefix_affinity = true\n").await;
    let workers = conversation(&r, 12).await;
    assert!(workers.iter().all(|w| *w == workers[0]), "{workers:?}");
    r.shutdown().await;
}

#[tokio::test]
async fn without_affinity_equal_ranks_share_the_turns() {
    let (_e, r) = two_equal_ranks("prefix_affinity = false\n").await;
    let workers = conversation(&r, 24).await;
    let first = workers.iter().filter(|w| **w == workers[0]).count();
    // Both ranks are within the tie margin: each turn goes to either (all 24 on one: 2^-23).
    assert!(first < workers.len(), "{workers:?}");
    r.shutdown().await;
}

#[tokio::test]
async fn affinity_gives_way_to_load() {
    let (e, r) = two_equal_ranks("prefix_affinity = true\naffinity_margin = 0.1\n").await;
    let workers = conversation(&r, 2).await;
    let home = workers[0].clone();
    // The conversation's rank fills up (0.6 above the other): the next turn goes by load.
    let home_rank: usize = home.rsplit('@').next().unwrap().parse().unwrap();
    let mut kv = vec![0.1, 0.1];
    kv[home_rank] = 0.7;
    e.set_kv_usage(kv);
    wait_workers(&r, std::time::Duration::from_secs(10), |rows| {
        rows[home_rank]["kv_usage"]
            .as_f64()
            .is_some_and(|k| k > 0.6)
    })
    .await;
    let next = conversation(&r, 1).await;
    assert_ne!(next[0], home, "a full rank is not chosen for its prefix");
    r.shutdown().await;
}
