//! Static adapters (`--lora-modules`) are models of their own: `/v1/models` lists each after the
//! base model with its `parent` and `root`, a request naming one is answered by it (with text of
//! its own), and a request naming none the engine serves gets vLLM 0.32's 404.

use serde_json::{json, Value};

use crate::common::{engine, get, post_json};
use crate::{assert_as_captured, captured, chat_for, content, lora_engine};

#[tokio::test]
async fn static_adapters_are_listed_with_their_parent_and_answer_with_their_own_text() {
    let e = engine(lora_engine(2, 1, &["sql-lora", "chat-lora"], false)).await;
    let models = get(e.addr, "/v1/models").await.json();
    let data = models["data"].as_array().unwrap();
    let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["tiny-llama", "sql-lora", "chat-lora"], "base first");
    assert_eq!(data[0]["parent"], Value::Null);
    // Every key a real adapter card has (the permission list aside) means what it means there.
    let real: Value = serde_json::from_str(&captured("models-after-load").body).unwrap();
    let real_card = &real["data"][1];
    assert_eq!(real_card["parent"], "tiny-llama");
    for key in ["object", "owned_by", "parent", "max_model_len"] {
        assert_eq!(data[1][key], real_card[key], "{key}");
    }
    assert_eq!(data[1]["root"], "org/sql-lora", "the adapter's path");

    let mut texts = Vec::new();
    for model in ["tiny-llama", "sql-lora", "chat-lora"] {
        let r = post_json(e.addr, "/v1/chat/completions", chat_for(model, 4, false)).await;
        assert_eq!(r.status, 200, "{model}");
        assert_eq!(r.json()["model"], model);
        texts.push(content(&r));
    }
    assert_eq!(texts[0], "t0 t1 t2 t3 ");
    assert_eq!(texts[1], "sql-lora:t0 sql-lora:t1 sql-lora:t2 sql-lora:t3 ");
    assert!(texts[1] != texts[2] && texts[0] != texts[2], "{texts:?}");
    // The same adapter answers the same prompt the same way: a test can tell who answered.
    let again = post_json(
        e.addr,
        "/v1/chat/completions",
        chat_for("sql-lora", 4, false),
    )
    .await;
    assert_eq!(content(&again), texts[1]);
    e.shutdown().await;
}

#[tokio::test]
async fn a_model_the_engine_does_not_serve_gets_vllms_404() {
    let e = engine(lora_engine(1, 1, &["sql-lora"], false)).await;
    let r = post_json(
        e.addr,
        "/v1/chat/completions",
        chat_for("chat-lora", 8, false),
    )
    .await;
    assert_as_captured(&r, "chat-chat-lora-before-load");
    // Completions resolve adapters the same way.
    let body = json!({"model": "sql-lora", "prompt": "x", "max_tokens": 2});
    let r = post_json(e.addr, "/v1/completions", body).await;
    assert_eq!(r.json()["choices"][0]["text"], "sql-lora:t0 sql-lora:t1 ");
    e.shutdown().await;
}

#[tokio::test]
async fn an_adapters_prompt_blocks_are_its_own_in_the_prefix_cache() {
    let cfg = rankgate_sim::sim::SimConfig {
        prefix_caching: true,
        ..lora_engine(1, 2, &["sql-lora", "chat-lora"], false)
    };
    let e = engine(cfg).await;
    // 40 tokens of prompt: two full blocks of 16, the same text every time.
    let prompt = "a prompt long enough to fill two blocks ".repeat(4);
    let ask = |model: &'static str| {
        let body = json!({"model": model, "prompt": prompt.clone(), "max_tokens": 1});
        post_json(e.addr, "/v1/completions", body)
    };
    let hits = || e.prefix_cache()[0].1;
    assert_eq!(ask("sql-lora").await.status, 200);
    assert_eq!(hits(), 0);
    assert_eq!(ask("chat-lora").await.status, 200);
    assert_eq!(ask("tiny-llama").await.status, 200);
    assert_eq!(
        hits(),
        0,
        "vLLM keys every block by its adapter: no hit across them"
    );
    assert_eq!(ask("sql-lora").await.status, 200);
    assert_eq!(hits(), 32, "the same adapter's blocks are found again");
    e.shutdown().await;
}
