//! Model routes (`[[routes]]`) over real sockets: two simulated engines, one serving
//! `llama-old`, the other `llama-new`, behind a router whose routes send `chat` to both by
//! weight. A canary splits as its weights say and every answer (each SSE chunk included) names
//! the target that served it, which is the engine that got it; a sticky header keeps a tenant on
//! one target while tenants spread; a reload moves weight without a restart; `/v1/models`
//! lists the routes, and a route whose target no engine serves is a 404 naming both.

mod common;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use rankgate::app::Router;
use rankgate::config::Config;
use rankgate_sim::sim::{SimConfig, SimEngine};
use serde_json::{json, Value};
use tokio::task::JoinSet;

use common::admin::TempConfig;
use common::*;

const OLD: &str = "llama-old";
const NEW: &str = "llama-new";

/// 90% to the old model, 10% to the new one.
const CANARY: &str = "[[routes]]\nmodel = \"chat\"\n\
    targets = [{ model = \"llama-old\", weight = 90 }, { model = \"llama-new\", weight = 10 }]\n";

/// An engine of one rank (`rank`) serving `model`, fast enough that a thousand requests take a
/// moment.
async fn serving_one(model: &str, rank: u32) -> SimEngine {
    engine(SimConfig {
        models: vec![model.to_string()],
        decode_tokens_per_sec: 5_000.0,
        dp_size: 1,
        start_rank: rank,
        ..SimConfig::default()
    })
    .await
}

/// The old and new engines behind a router started from a file with `routes` (rewritten by the
/// reload test), every rank available and every model list read.
async fn setup(routes: &str) -> (SimEngine, SimEngine, Router, TempConfig) {
    let (old, new) = (serving_one(OLD, 0).await, serving_one(NEW, 1).await);
    let file = TempConfig::new(&config(&old, &new, routes));
    let cfg = Config::load(&file.0).unwrap();
    let r = Router::start_from(cfg, Some(file.0.clone())).await.unwrap();
    wait_state(&r, &[0, 1], "available").await;
    wait_models(&r).await;
    (old, new, r, file)
}

fn config(old: &SimEngine, new: &SimEngine, routes: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n{FAST}{routes}{}{}",
        engine_toml(&old.url(), "vllm", 1, 0),
        engine_toml(&new.url(), "vllm", 1, 1),
    )
}

fn chat_for(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
}

/// `n` chats naming `model` (with `headers`), 50 at a time; their replies in no order.
async fn chats(r: &Router, model: &str, headers: &[(&str, &str)], n: usize) -> Vec<Reply> {
    let mut replies = Vec::with_capacity(n);
    for start in (0..n).step_by(50) {
        let mut batch = JoinSet::new();
        for _ in start..n.min(start + 50) {
            let mut req = post(r.addr, "/v1/chat/completions");
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            let body = Full::new(Bytes::from(chat_for(model).to_string()));
            batch.spawn(send(req.body(body).unwrap()));
        }
        while let Some(reply) = batch.join_next().await {
            replies.push(reply.unwrap());
        }
    }
    replies
}

/// The `model` each reply names, checked against the engine that answered it.
fn models(replies: &[Reply], old: &SimEngine, new: &SimEngine) -> Vec<String> {
    (replies.iter())
        .map(|reply| {
            assert_eq!(
                reply.status,
                200,
                "{}",
                String::from_utf8_lossy(&reply.body)
            );
            let model = reply.json()["model"].as_str().unwrap().to_string();
            let engine = if model == NEW { new } else { old };
            assert!(
                reply.worker().starts_with(&engine.url()),
                "{model} answered by {}",
                reply.worker()
            );
            model
        })
        .collect()
}

/// The models a simulated engine was sent in chat bodies.
fn seen_models(e: &SimEngine) -> Vec<String> {
    (e.seen().iter())
        .filter(|s| s.path == "/v1/chat/completions")
        .filter_map(|s| s.model.clone())
        .collect()
}

/// The value of the `/metrics` series whose line starts with `series` (labels and all).
async fn metric(r: &Router, series: &str) -> Option<f64> {
    let page = get(r.admin_addr, "/metrics").await;
    let page = String::from_utf8_lossy(&page.body).to_string();
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_splits_by_weight_and_each_answer_names_its_target() {
    let (old, new, r, _file) = setup(CANARY).await;
    let replies = chats(&r, "chat", &[], 1_000).await;
    let got = models(&replies, &old, &new);
    let to_new = got.iter().filter(|m| *m == NEW).count();
    assert!(
        (70..=130).contains(&to_new),
        "{to_new} of 1000 to the canary"
    );
    assert_eq!(got.len() - to_new, got.iter().filter(|m| *m == OLD).count());
    // The engines were sent the target's name, never the route's.
    assert_eq!(seen_models(&new), vec![NEW.to_string(); to_new]);
    assert!(seen_models(&old).iter().all(|m| m == OLD));

    // Counted under both names: the route's counter per target, the requests under the target.
    let route = |t: &str| format!("rankgate_route_requests_total{{route=\"chat\",target=\"{t}\"}}");
    assert_eq!(metric(&r, &route(NEW)).await, Some(to_new as f64));
    assert_eq!(metric(&r, &route(OLD)).await, Some((1_000 - to_new) as f64));
    let page = String::from_utf8_lossy(&get(r.admin_addr, "/metrics").await.body).to_string();
    let requests = |m: &str| {
        (page.lines())
            .filter(|l| {
                l.starts_with("rankgate_requests_total{") && l.contains(&format!("model=\"{m}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert_eq!(requests(NEW), to_new as f64, "{page}");
    assert_eq!(requests("chat"), 0.0, "the route is not a model label");

    // The admin page: weights, shares and the same counts.
    let page = get(r.admin_addr, "/routes").await.json();
    let targets = &page["routes"][0]["targets"];
    assert_eq!(page["routes"][0]["model"], "chat");
    assert_eq!(targets[1]["model"], NEW);
    assert_eq!(targets[1]["weight"], 10);
    assert_eq!(targets[1]["requests"], to_new as u64);
    assert_eq!(targets[0]["served"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_chunk_of_a_stream_names_the_target() {
    let alias = "[[routes]]\nmodel = \"fast\"\ntargets = [{ model = \"llama-new\" }]\n";
    let (_old, _new, r, _file) = setup(alias).await;
    let mut body = chat_for("fast");
    body["stream"] = json!(true);
    body["max_tokens"] = json!(8);
    let req = post(r.addr, "/v1/chat/completions").body(Full::new(Bytes::from(body.to_string())));
    let resp = client().request(req.unwrap()).await.unwrap();
    assert_eq!(resp.status(), 200);
    let text = resp.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&text);
    let chunks: Vec<Value> = (text.lines())
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks.len() >= 8, "{text}");
    assert!(chunks.iter().all(|c| c["model"] == NEW), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sticky_header_keeps_a_tenant_on_one_target_while_tenants_spread() {
    let sticky =
        "[[routes]]\nmodel = \"chat\"\nsticky_header = \"x-gateway-inference-fairness-id\"\n\
        targets = [{ model = \"llama-old\", weight = 1 }, { model = \"llama-new\", weight = 1 }]\n";
    let (old, new, r, _file) = setup(sticky).await;
    let mut per_tenant = Vec::new();
    for t in 0..16 {
        let tenant = format!("tenant-{t}");
        let replies = chats(
            &r,
            "chat",
            &[("x-gateway-inference-fairness-id", &tenant)],
            8,
        )
        .await;
        let mut got = models(&replies, &old, &new);
        got.dedup();
        assert_eq!(got.len(), 1, "{tenant} went to {got:?}");
        per_tenant.push(got.remove(0));
    }
    assert!(
        per_tenant.contains(&OLD.to_string()) && per_tenant.contains(&NEW.to_string()),
        "{per_tenant:?}"
    );
    // Without the header: drawn at random, both targets over 40 requests.
    let got = models(&chats(&r, "chat", &[], 40).await, &old, &new);
    assert!(
        got.contains(&OLD.to_string()) && got.contains(&NEW.to_string()),
        "{got:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_moves_the_weight_without_a_restart() {
    let before = "[[routes]]\nmodel = \"chat\"\n\
        targets = [{ model = \"llama-old\", weight = 100 }, { model = \"llama-new\", weight = 0 }]\n";
    let (old, new, r, file) = setup(before).await;
    let got = models(&chats(&r, "chat", &[], 50).await, &old, &new);
    assert!(got.iter().all(|m| m == OLD), "{got:?}");

    let after = before.replace("weight = 100", "weight = 0").replacen(
        "weight = 0 }]",
        "weight = 100 }]",
        1,
    );
    std::fs::write(&file.0, config(&old, &new, &after)).unwrap();
    let done = r.reload().await.unwrap();
    assert!(done.restart_needed.is_empty(), "{:?}", done.restart_needed);
    let got = models(&chats(&r, "chat", &[], 50).await, &old, &new);
    assert!(got.iter().all(|m| m == NEW), "{got:?}");
    // The counters carried over the reload.
    let page = get(r.admin_addr, "/routes").await.json();
    let targets = &page["routes"][0]["targets"];
    assert_eq!(
        (targets[0]["weight"].clone(), targets[0]["requests"].clone()),
        (json!(0), json!(50))
    );
    assert_eq!(
        (targets[1]["weight"].clone(), targets[1]["requests"].clone()),
        (json!(100), json!(50))
    );

    // A bad file changes nothing, and says which key.
    std::fs::write(
        &file.0,
        config(&old, &new, &after.replace("weight = 100", "weight = -1")),
    )
    .unwrap();
    let err = r.reload().await.unwrap_err().to_string();
    assert!(err.contains("routes[0].targets[1].weight"), "{err}");
    let got = models(&chats(&r, "chat", &[], 10).await, &old, &new);
    assert!(got.iter().all(|m| m == NEW), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_are_listed_and_an_unserved_target_is_a_404_naming_the_route() {
    let routes = format!(
        "{CANARY}[[routes]]\nmodel = \"ghost\"\ntargets = [{{ model = \"no-such-model\" }}]\n"
    );
    let (old, new, r, _file) = setup(&routes).await;
    let list = get(r.addr, "/v1/models").await.json();
    let ids: Vec<&str> = (list["data"].as_array().unwrap().iter())
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["chat", "ghost", NEW, OLD]);
    let chat = get(r.addr, "/v1/models/chat").await.json();
    assert_eq!(chat["owned_by"], "rankgate");
    assert_eq!(
        chat["targets"],
        json!([{"model": OLD, "weight": 90}, {"model": NEW, "weight": 10}])
    );

    let reply = post_json(r.addr, "/v1/chat/completions", chat_for("ghost")).await;
    assert_eq!(reply.status, 404);
    let v = reply.json();
    assert_eq!(
        (v["error"]["type"].as_str(), v["error"]["code"].as_str()),
        (Some("NotFoundError"), Some("model_not_found"))
    );
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("`ghost`") && message.contains("`no-such-model`"),
        "{message}"
    );
    // A model the engines serve goes as it is named; one nobody serves is the usual 404.
    let got = models(
        &[post_json(r.addr, "/v1/chat/completions", chat_for(OLD)).await],
        &old,
        &new,
    );
    assert_eq!(got, [OLD]);
    let reply = post_json(r.addr, "/v1/chat/completions", chat_for("nothing")).await;
    assert_eq!(
        (reply.status, reply.json()["error"]["code"].as_str()),
        (http::StatusCode::NOT_FOUND, Some("model_not_found"))
    );
}
