//! What the simulated engine serves and records: every served model listed and routed by name, an
//! unknown model a vLLM-shaped 404, an empty model list refused, API keys guarding what each
//! engine guards, and what it saw of each request with the rank that served it.

use bytes::Bytes;
use http::StatusCode;
use http_body_util::Full;
use rankgate_sim::sim::{SimConfig, SimEngine, SimFlavor};
use serde_json::json;

use crate::common;
use crate::common::{engine, get, post, post_json, send, sim, Reply};
use crate::helpers::*;

#[tokio::test]
async fn lists_every_served_model_and_routes_by_name() {
    let e = engine(two_models(SimFlavor::Vllm)).await;
    let models = get(e.addr, "/v1/models").await.json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["alpha", "beta"]);
    assert_eq!(models["data"][1]["root"], "beta");
    assert_eq!(models["data"][1]["object"], "model");

    for (named, echoed) in [
        (Some("beta"), "beta"),
        (Some("alpha"), "alpha"),
        (None, "alpha"),
    ] {
        let mut body = json!({"prompt": "hi", "max_tokens": 2});
        if let Some(m) = named {
            body["model"] = json!(m);
        }
        let r = post_json(e.addr, "/v1/completions", body).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.json()["model"], echoed);
    }
}

#[tokio::test]
async fn unknown_model_is_a_vllm_shaped_404() {
    for flavor in [SimFlavor::Vllm, SimFlavor::Sglang] {
        let e = engine(two_models(flavor)).await;
        let body = json!({"model": "gamma", "messages": [{"role": "user", "content": "hi"}]});
        let r = post_json(e.addr, "/v1/chat/completions", body).await;
        assert_eq!(r.status, StatusCode::NOT_FOUND);
        assert_eq!(
            r.json(),
            json!({"error": {"message": "The model `gamma` does not exist.",
                "type": "NotFoundError", "param": "model", "code": 404}})
        );
        assert_eq!(e.served(), [0, 0], "a refused request admits nothing");
    }
}

#[tokio::test]
async fn an_empty_model_list_is_refused() {
    let cfg = SimConfig {
        models: Vec::new(),
        ..SimConfig::default()
    };
    let err = SimEngine::start(common::loopback(), cfg)
        .await
        .err()
        .unwrap();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
}

fn keyed(flavor: SimFlavor) -> SimConfig {
    SimConfig {
        api_key: Some("sekret".into()),
        ..sim(flavor, 2, 0)
    }
}

async fn get_with(e: &SimEngine, path: &str, authorization: Option<&str>) -> Reply {
    let mut req = http::Request::get(format!("http://{}{path}", e.addr));
    if let Some(a) = authorization {
        req = req.header("authorization", a);
    }
    send(req.body(Full::new(Bytes::new())).unwrap()).await
}

#[tokio::test]
async fn api_key_guards_what_each_engine_guards() {
    let e = engine(keyed(SimFlavor::Vllm)).await;
    let r = get_with(&e, "/v1/models", None).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.json(), json!({"error": "Unauthorized"}));
    assert_eq!(
        get_with(&e, "/v1/models", Some("Bearer wrong"))
            .await
            .status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        get_with(&e, "/v1/models", Some("Bearer sekret"))
            .await
            .status,
        StatusCode::OK
    );
    // vLLM leaves its unversioned paths open.
    assert_eq!(get_with(&e, "/health", None).await.status, StatusCode::OK);
    assert_eq!(get_with(&e, "/metrics", None).await.status, StatusCode::OK);
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    let chat = |auth: Option<&'static str>| {
        let mut req = post(e.addr, "/v1/chat/completions");
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        send(req.body(Full::new(Bytes::from(body.to_string()))).unwrap())
    };
    assert_eq!(chat(None).await.status, StatusCode::UNAUTHORIZED);
    assert_eq!(e.requests_received(), 0, "refused before the handler");
    assert_eq!(chat(Some("Bearer sekret")).await.status, StatusCode::OK);

    // SGLang guards everything but /health and /metrics, its load report included.
    let s = engine(keyed(SimFlavor::Sglang)).await;
    assert_eq!(get_with(&s, "/health", None).await.status, StatusCode::OK);
    assert_eq!(get_with(&s, "/metrics", None).await.status, StatusCode::OK);
    let loads = get_with(&s, "/v1/loads", None).await;
    assert_eq!(loads.status, StatusCode::UNAUTHORIZED);
    assert_eq!(loads.json(), json!({"error": "Unauthorized"}));
    assert_eq!(
        get_with(&s, "/v1/loads", Some("Bearer sekret"))
            .await
            .status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn records_what_it_saw_and_names_the_serving_rank() {
    // Second node of a 2x2 deployment: global ranks 2 and 3.
    let e = engine(SimConfig {
        api_key: Some("sekret".into()),
        ..sim(SimFlavor::Vllm, 2, 2)
    })
    .await;
    let body = json!({"model": "tiny-llama", "prompt": "hi", "max_tokens": 1});
    let r = send(
        post(e.addr, "/v1/completions")
            .header("authorization", "Bearer sekret")
            .header("x-data-parallel-rank", "3")
            .header("x-request-id", "req-7")
            .header("x-forwarded-for", "10.1.2.3")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.headers["x-sim-rank"], "3");
    let seen = e.seen();
    let s = &seen[0];
    assert_eq!(s.method, http::Method::POST);
    assert_eq!(s.path, "/v1/completions");
    assert_eq!(s.rank, 3);
    assert_eq!(s.rank_header.as_deref(), Some("3"));
    assert_eq!(s.model.as_deref(), Some("tiny-llama"));
    assert_eq!(s.authorization.as_deref(), Some("Bearer sekret"));
    assert_eq!(s.request_id.as_deref(), Some("req-7"));
    assert_eq!(s.forwarded_for.as_deref(), Some("10.1.2.3"));

    // An unpinned request still says where it ran, and a refused model is recorded too.
    let r = post_json(
        e.addr,
        "/v1/embeddings",
        json!({"model": "nope", "input": "x"}),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED, "no key, no record");
    let r = send(
        post(e.addr, "/v1/embeddings")
            .header("authorization", "Bearer sekret")
            .body(Full::new(Bytes::from(
                json!({"model": "nope", "input": "x"}).to_string(),
            )))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let rank: u32 = r.headers["x-sim-rank"].to_str().unwrap().parse().unwrap();
    assert!((2..4).contains(&rank));
    let seen = e.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].model.as_deref(), Some("nope"));
    assert_eq!(seen[1].request_id, None);
}
