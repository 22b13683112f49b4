//! More adapters than slots: each rank runs at most `max_loras` adapters at once and sets the
//! others' requests aside, yet every request completes, answered by the adapter it named.

use std::time::Duration;

use rankgate_sim::sim::SimConfig;
use tokio::task::JoinSet;

use crate::common::{engine, post_json};
use crate::{chat_for, content, lora_engine};

#[tokio::test]
async fn requests_for_more_adapters_than_slots_all_complete() {
    let adapters = ["a", "b", "c", "d", "e", "f"];
    let cfg = SimConfig {
        decode_tokens_per_sec: 500.0,
        ..lora_engine(2, 2, &adapters, false)
    };
    let e = engine(cfg).await;
    let mut calls = JoinSet::new();
    for i in 0..48 {
        // Every seventh request is the base model's, which takes no slot.
        let model = match i % 7 {
            6 => "tiny-llama",
            n => adapters[n % adapters.len()],
        };
        let addr = e.addr;
        calls.spawn(async move {
            let r = post_json(addr, "/v1/chat/completions", chat_for(model, 6, false)).await;
            (model, r)
        });
    }
    let all = tokio::time::timeout(Duration::from_secs(60), async {
        let mut out = Vec::new();
        while let Some(done) = calls.join_next().await {
            out.push(done.expect("the call"));
        }
        out
    })
    .await
    .expect("every request completes");
    assert_eq!(all.len(), 48);
    for (model, r) in &all {
        assert_eq!(r.status, 200, "{model}");
        let text = content(r);
        match *model {
            "tiny-llama" => assert!(text.starts_with("t0 "), "{text}"),
            m => assert!(text.starts_with(&format!("{m}:t0 ")), "{m}: {text}"),
        }
    }
    let waits: u64 = e.lora_slot_waits().iter().sum();
    let loads: u64 = e.lora_loads().iter().sum();
    assert!(waits > 0, "six adapters over two slots per rank: some wait");
    assert!(
        loads >= adapters.len() as u64,
        "each adapter loaded somewhere"
    );
    e.shutdown().await;
}
