//! Adapters loaded on demand (`[[adapters]]`) through rankgate, on simulated vLLM servers with
//! runtime updating: the first requests for a declared adapter no server has load it once and
//! all answer with its text; a load that fails is answered with the engine's words and not
//! tried again at once; a server at `max_adapters` unloads the least recently used declared
//! adapter; a route may name a declared adapter; the admin API lists, loads and unloads.

use std::time::Duration;

use http::Method;
use serde_json::{json, Value};

use crate::common::admin::{admin, token_env, TOKEN};
use crate::common::{engine, get, post_json, router_with, wait_models, Reply, FAST};
use crate::{chat_for, content, lora_engine};
use rankgate::app::Router;
use rankgate_sim::sim::SimEngine;

const CHAT: &str = "/v1/chat/completions";

/// A DP=1 server of the sim's base model with runtime updating, no adapter, whose loads take
/// `load`.
async fn server(load: Duration) -> SimEngine {
    let mut cfg = lora_engine(1, 1, &[], true);
    if let Some(l) = cfg.lora.as_mut() {
        l.load_delay = load;
    }
    engine(cfg).await
}

fn declared(name: &str, path: &str) -> String {
    format!("[[adapters]]\nname = \"{name}\"\nbase = \"tiny-llama\"\npath = \"{path}\"\n")
}

/// A server that is its own DP deployment.
fn own(e: &SimEngine) -> String {
    format!("[[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\n", e.url())
}

/// An admin call to load or unload by hand (`path`), with the token.
async fn hand(r: &Router, path: &str, body: Value) -> Reply {
    admin(r, Method::POST, path, Some(TOKEN), Some(body)).await
}

fn loads(servers: &[&SimEngine]) -> u64 {
    servers.iter().map(|s| s.lora_load_requests()).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_requests_for_a_declared_adapter_load_it_once_and_all_get_its_answer() {
    let (a, b) = (
        server(Duration::from_millis(300)).await,
        server(Duration::from_millis(300)).await,
    );
    let extra = format!("{FAST}{}", declared("sql-lora", "org/sql-lora"));
    let engines = [own(&a), own(&b)];
    let r = router_with("", &extra, &engines).await;
    wait_models(&r).await;
    // Listed before any server has it: a client can discover it.
    let models = get(r.addr, "/v1/models").await.json();
    let entry = (models["data"].as_array().unwrap().iter())
        .find(|m| m["id"] == "sql-lora")
        .unwrap_or_else(|| panic!("{models}"));
    assert_eq!(entry["parent"], "tiny-llama");

    let first: Vec<_> = (0..8)
        .map(|_| tokio::spawn(post_json(r.addr, CHAT, chat_for("sql-lora", 2, false))))
        .collect();
    let mut workers = Vec::new();
    for f in first {
        let reply = f.await.unwrap();
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        assert_eq!(content(&reply), "sql-lora:t0 sql-lora:t1 ");
        workers.push(reply.worker());
    }
    assert_eq!(loads(&[&a, &b]), 1, "eight first requests, one load");
    let holder = match a.adapters().contains(&"sql-lora".to_string()) {
        true => a.url(),
        false => b.url(),
    };
    assert_eq!(a.adapters().len() + b.adapters().len(), 1);
    for _ in 0..10 {
        let reply = post_json(r.addr, CHAT, chat_for("sql-lora", 2, false)).await;
        assert_eq!(reply.status, 200);
        assert_eq!(content(&reply), "sql-lora:t0 sql-lora:t1 ");
        workers.push(reply.worker());
    }
    assert!(
        workers.iter().all(|w| w.starts_with(&holder)),
        "{workers:?}"
    );
    assert_eq!(loads(&[&a, &b]), 1, "served where loaded, not loaded again");
    let metrics = admin(&r, Method::GET, "/metrics", None, None).await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("rankgate_adapter_loads_total{result=\"loaded\"} 1\n"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_load_is_answered_in_the_engines_words_and_not_retried_in_a_loop() {
    let a = server(Duration::from_millis(1)).await;
    let nowhere = "[[adapters]]\nname = \"far-lora\"\nbase = \"other-model\"\npath = \"org/far\"\n";
    let extra = format!(
        "{FAST}{}{nowhere}",
        declared("ghost-lora", "/nonexistent/ghost")
    );
    let r = router_with("", &extra, &[own(&a)]).await;
    wait_models(&r).await;
    for _ in 0..5 {
        let reply = post_json(r.addr, CHAT, chat_for("ghost-lora", 2, false)).await;
        assert_eq!(reply.status, 502);
        let err = reply.json();
        let msg = err["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("ghost-lora") && msg.contains("No adapter found for /nonexistent/ghost"),
            "{msg}"
        );
        assert_eq!(err["error"]["code"], "adapter_not_loaded");
    }
    assert_eq!(a.lora_load_requests(), 1, "five requests, one load tried");
    let metrics = admin(&r, Method::GET, "/metrics", None, None).await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("rankgate_adapter_loads_total{result=\"failed\"} 1\n"),
        "{text}"
    );
    // An adapter whose base no server serves: 503 naming the base, nothing asked of anyone.
    for _ in 0..3 {
        let reply = post_json(r.addr, CHAT, chat_for("far-lora", 2, false)).await;
        assert_eq!(reply.status, 503);
        let msg = reply.json()["error"]["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            msg.contains("far-lora") && msg.contains("other-model"),
            "{msg}"
        );
    }
    assert_eq!(a.lora_load_requests(), 1);
    let page = admin(&r, Method::GET, "/adapters", None, None).await.json();
    assert_eq!(page["failed"][0]["adapter"], "ghost-lora", "{page}");
    // Other models are not affected.
    let reply = post_json(r.addr, CHAT, chat_for("tiny-llama", 2, false)).await;
    assert_eq!(reply.status, 200);
    // A router that tells clients nothing of its fleet names the adapter, not the server or
    // the engine's reply.
    let quiet = router_with("expose_worker = \"none\"\n", &extra, &[own(&a)]).await;
    wait_models(&quiet).await;
    let reply = post_json(quiet.addr, CHAT, chat_for("ghost-lora", 2, false)).await;
    assert_eq!(reply.status, 502);
    let msg = reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("ghost-lora") && !msg.contains("127.0.0.1") && !msg.contains("nonexistent"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_at_its_limit_unloads_the_least_recently_used_declared_adapter() {
    let a = server(Duration::from_millis(1)).await;
    let names = ["a-lora", "b-lora", "c-lora"];
    let mut extra = FAST.to_string();
    for n in names {
        extra.push_str(&declared(n, &format!("org/{n}")));
    }
    // A route naming a declared adapter loads it like a request naming it.
    extra.push_str("[[routes]]\nmodel = \"chat\"\ntargets = [{ model = \"c-lora\" }]\n");
    let engines = [format!("{}max_adapters = 2\n", own(&a))];
    let r = router_with("", &extra, &engines).await;
    wait_models(&r).await;
    for (model, want) in [
        ("a-lora", "a-lora"),
        ("b-lora", "b-lora"),
        ("a-lora", "a-lora"),
        ("chat", "c-lora"),
    ] {
        let reply = post_json(r.addr, CHAT, chat_for(model, 1, false)).await;
        assert_eq!(
            reply.status,
            200,
            "{model}: {}",
            String::from_utf8_lossy(&reply.body)
        );
        assert_eq!(content(&reply), format!("{want}:t0 "));
    }
    // b-lora was used less lately than a-lora: it made room for c-lora.
    assert_eq!(a.adapters(), ["a-lora", "c-lora"]);
    assert_eq!(a.lora_load_requests(), 3);
    // b-lora again, unloaded once already: the limit holds, and a-lora (used before c-lora
    // was loaded) makes room.
    let reply = post_json(r.addr, CHAT, chat_for("b-lora", 1, false)).await;
    assert_eq!(reply.status, 200);
    assert_eq!(a.adapters(), ["c-lora", "b-lora"]);
    assert_eq!(a.lora_load_requests(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_lists_loads_and_unloads_adapters_per_server() {
    let a = server(Duration::from_millis(1)).await;
    let extra = format!("{FAST}{}", declared("sql-lora", "org/sql-lora"));
    let r = router_with(&token_env(), &extra, &[own(&a)]).await;
    wait_models(&r).await;
    let call = json!({"server": a.url(), "adapter": "sql-lora"});
    let denied = admin(&r, Method::POST, "/adapters/load", None, Some(call.clone())).await;
    assert_eq!(denied.status, 401);
    let done = hand(&r, "/adapters/load", call.clone()).await;
    assert_eq!(done.status, 200, "{}", String::from_utf8_lossy(&done.body));
    assert_eq!(a.adapters(), ["sql-lora"]);
    // One not declared needs its path.
    let other = json!({"server": a.url(), "adapter": "chat-lora"});
    let r2 = hand(&r, "/adapters/load", other).await;
    let v = r2.assert_openai_error(400, None);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("path"),
        "{v}"
    );
    let with_path = json!({"server": a.url(), "adapter": "chat-lora", "path": "org/chat-lora"});
    let r3 = hand(&r, "/adapters/load", with_path).await;
    assert_eq!(r3.status, 200);

    let page: Value = admin(&r, Method::GET, "/adapters", None, None).await.json();
    let listed: Vec<&str> = (page["servers"][0]["adapters"].as_array().unwrap().iter())
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    assert_eq!(listed, ["sql-lora", "chat-lora"], "{page}");
    assert_eq!(page["servers"][0]["adapters"][0]["declared"], true);
    assert_eq!(page["declared"][0]["served"], true);

    let gone = hand(&r, "/adapters/unload", call).await;
    assert_eq!(gone.status, 200);
    assert_eq!(a.adapters(), ["chat-lora"]);
    let nowhere = json!({"server": "http://127.0.0.1:1", "adapter": "sql-lora"});
    let r4 = hand(&r, "/adapters/unload", nowhere).await;
    r4.assert_openai_error(404, None);
    for bad in [
        json!([a.url(), "arr-lora", "org/arr"]),
        json!({"server": a.url(), "adapter": "a\u{0}b", "path": "org/x"}),
        json!({"server": a.url(), "adapter": " sql-lora", "path": "org/x"}),
        json!({"server": a.url(), "adapter": "x", "path": "org/\n"}),
    ] {
        let reply = hand(&r, "/adapters/load", bad.clone()).await;
        assert_eq!(
            reply.status,
            400,
            "{bad}: {}",
            String::from_utf8_lossy(&reply.body)
        );
    }
    assert_eq!(a.adapters(), ["chat-lora"]);
    let garbage = hand(&r, "/adapters/load", json!([1])).await;
    garbage.assert_openai_error(400, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_servers_lora_gauge_gives_its_slots_and_on_one_rank_what_runs() {
    // --max-loras 2, and rankgate not told: the gauge says it.
    let a = engine(lora_engine(1, 2, &["sql-lora"], false)).await;
    let r = router_with("", FAST, &[own(&a)]).await;
    wait_models(&r).await;
    let reply = post_json(r.addr, CHAT, chat_for("sql-lora", 1, false)).await;
    assert_eq!(reply.status, 200);
    let rows =
        crate::common::wait_workers(&r, Duration::from_secs(10), |rows| rows[0]["max_lora"] == 2)
            .await;
    assert_eq!(rows[0]["max_lora"], 2, "{rows:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_says_it_loaded_an_adapter_it_does_not_list_is_not_asked_again_at_once() {
    let e = crate::common::recorded::RecordedVllm::start().await;
    let extra = format!("{FAST}{}", declared("sql-lora", "org/sql-lora"));
    let cfg = format!("[[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\n", e.url());
    let r = router_with("", &extra, &[cfg]).await;
    wait_models(&r).await;
    for _ in 0..10 {
        let reply = post_json(r.addr, CHAT, chat_for("sql-lora", 1, false)).await;
        assert_eq!(
            reply.status,
            503,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        let msg = reply.json()["error"]["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(msg.contains("does not list it"), "{msg}");
    }
    assert_eq!(e.lora_loads(), 1, "ten requests, one load");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_adapter_loads_where_lists_are_known_not_where_one_is_not() {
    // B answers everything but its model list: its list is never known.
    let a = server(Duration::from_millis(1)).await;
    let mut silent = lora_engine(1, 1, &[], true);
    silent.hang_models = true;
    let b = engine(silent).await;
    let extra = format!("{FAST}{}", declared("sql-lora", "org/sql-lora"));
    let r = router_with("", &extra, &[own(&a), own(&b)]).await;
    crate::common::wait_workers(&r, Duration::from_secs(10), |rows| {
        rows[0]["models"].as_array().is_some_and(|m| !m.is_empty())
    })
    .await;
    for _ in 0..3 {
        let reply = post_json(r.addr, CHAT, chat_for("sql-lora", 1, false)).await;
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        assert_eq!(content(&reply), "sql-lora:t0 ");
        assert!(reply.worker().starts_with(&a.url()), "{}", reply.worker());
    }
    assert_eq!((a.lora_load_requests(), b.lora_load_requests()), (1, 0));
}
