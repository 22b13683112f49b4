//! Runtime adapter updates (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`, the sim's
//! `--allow-runtime-lora`): every answer the real vLLM 0.32 gave to `bench/lora-facts.sh`'s
//! sequence (load, load again, a bad path, a field missing, unload, unload again), the model list
//! following them, and the routes missing without runtime updating.

use serde_json::json;

use crate::common::{engine, get, post_json};
use crate::{assert_as_captured, chat_for, content, lora_engine};
use rankgate_sim::sim::lora::config::MAX_ADAPTERS;

const LOAD: &str = "/v1/load_lora_adapter";
const UNLOAD: &str = "/v1/unload_lora_adapter";

fn ids(models: &serde_json::Value) -> Vec<String> {
    (models["data"].as_array().unwrap().iter())
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn runtime_loads_and_unloads_answer_as_vllm_0_32() {
    let e = engine(lora_engine(2, 1, &["sql-lora"], true)).await;
    // A local path must be a directory, as vLLM reads the adapter's files from it.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("sim-lora/chat-lora");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.to_str().unwrap();
    let load = json!({"lora_name": "chat-lora", "lora_path": path});
    assert_as_captured(&post_json(e.addr, LOAD, load.clone()).await, "load-ok");
    assert_as_captured(&post_json(e.addr, LOAD, load.clone()).await, "load-again");
    let bad = json!({"lora_name": "nowhere-lora", "lora_path": "/nonexistent/lora"});
    assert_as_captured(&post_json(e.addr, LOAD, bad).await, "load-bad-path");
    let half = json!({"lora_name": "half"});
    assert_as_captured(&post_json(e.addr, LOAD, half).await, "load-no-path");

    let models = get(e.addr, "/v1/models").await.json();
    assert_eq!(ids(&models), ["tiny-llama", "sql-lora", "chat-lora"]);
    assert_eq!(models["data"][2]["root"], path);
    assert_eq!(models["data"][2]["parent"], "tiny-llama");
    let r = post_json(
        e.addr,
        "/v1/chat/completions",
        chat_for("chat-lora", 2, false),
    )
    .await;
    assert_eq!(content(&r), "chat-lora:t0 chat-lora:t1 ");

    let unload = json!({"lora_name": "chat-lora"});
    assert_as_captured(
        &post_json(e.addr, UNLOAD, unload.clone()).await,
        "unload-ok",
    );
    assert_as_captured(&post_json(e.addr, UNLOAD, unload).await, "unload-unknown");
    let models = get(e.addr, "/v1/models").await.json();
    assert_eq!(ids(&models), ["tiny-llama", "sql-lora"]);
    let r = post_json(
        e.addr,
        "/v1/chat/completions",
        chat_for("chat-lora", 2, false),
    )
    .await;
    r.assert_openai_error(404, Some("NotFoundError"));

    // Unloaded, it can be loaded again (a repository id is found without a directory).
    let again = json!({"lora_name": "chat-lora", "lora_path": "org/chat-lora"});
    assert_eq!(post_json(e.addr, LOAD, again).await.status, 200);
    let r = post_json(e.addr, UNLOAD, json!({"lora_name": ""})).await;
    let v = r.assert_openai_error(400, Some("InvalidUserInput"));
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("'lora_name'"));
    e.shutdown().await;
}

#[tokio::test]
async fn a_reload_in_place_is_accepted_and_the_adapter_bound_is_clear() {
    let names: Vec<String> = (0..MAX_ADAPTERS).map(|i| format!("a{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let e = engine(lora_engine(1, 1, &refs, true)).await;
    let inplace = json!({"lora_name": "a0", "lora_path": "org/a0-v2", "load_inplace": true});
    assert_eq!(post_json(e.addr, LOAD, inplace).await.status, 200);
    let models = get(e.addr, "/v1/models").await.json();
    assert_eq!(
        models["data"][1]["root"], "org/a0-v2",
        "same place, new path"
    );
    let more = json!({"lora_name": "one-more", "lora_path": "org/x"});
    let r = post_json(e.addr, LOAD, more).await;
    let v = r.assert_openai_error(400, Some("InvalidUserInput"));
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains(&format!("at most {MAX_ADAPTERS}")), "{msg}");
    e.shutdown().await;
}

#[tokio::test]
async fn without_runtime_updating_the_routes_do_not_exist() {
    let e = engine(lora_engine(1, 1, &["sql-lora"], false)).await;
    for path in [LOAD, UNLOAD] {
        let body = json!({"lora_name": "x", "lora_path": "org/x"});
        assert_eq!(post_json(e.addr, path, body).await.status, 404, "{path}");
    }
    assert_eq!(e.adapters(), ["sql-lora"]);
    e.shutdown().await;
}
