//! The SGLang endpoints the simulated engine imitates, answered in shape on the pinned rank, how it
//! describes itself, and the fault knobs reaching the newer endpoints.

use http::StatusCode;
use rankgate_sim::sim::{SimConfig, SimFlavor};
use serde_json::{json, Value};

use crate::common::{engine, get, post_json, sim};
use crate::helpers::*;

#[tokio::test]
async fn sglang_endpoints_answer_in_shape_on_the_pinned_rank() {
    // Global ranks 2 and 3, both named in the body as a router pins SGLang.
    let e = engine(SimConfig {
        models: vec!["alpha".into(), "beta".into()],
        ..sim(SimFlavor::Sglang, 2, 2)
    })
    .await;
    let cases: Vec<Case> = vec![
        (
            "/generate",
            json!({"text": "hi", "sampling_params": {"max_new_tokens": 3}}),
            |v| {
                v["text"] == "t0 t1 t2 "
                    && v["meta_info"]["completion_tokens"] == 3
                    && v["meta_info"]["finish_reason"]["type"] == "length"
            },
        ),
        ("/encode", json!({"text": "hi"}), |v| {
            v["embedding"].is_array() && v["meta_info"].is_object()
        }),
        ("/classify", json!({"text": "hi"}), |v| {
            v["embedding"].is_array()
        }),
        (
            "/v1/rerank",
            json!({"query": "q", "documents": ["a", "b", "c"]}),
            |v| {
                let r = v.as_array().unwrap();
                r.len() == 3 && r[2]["document"] == "c" && r[0]["score"].is_number()
            },
        ),
        (
            "/v1/score",
            json!({"model": "beta", "query": "q", "items": ["a", "b"]}),
            |v| {
                v["object"] == "scoring"
                    && v["scores"].as_array().unwrap().len() == 2
                    && v["model"] == "beta"
            },
        ),
        (
            "/v1/responses",
            json!({"model": "beta", "input": "hi", "max_output_tokens": 1}),
            |v| v["object"] == "response" && v["model"] == "beta",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "beta", "messages": [], "max_tokens": 1}),
            |v| v["object"] == "chat.completion" && v["model"] == "beta",
        ),
        ("/v1/embeddings", json!({"input": "x"}), |v| {
            v["model"] == "alpha"
        }),
    ];
    for (i, (path, body, shaped)) in cases.into_iter().enumerate() {
        let rank = 2 + (i % 2) as u32;
        let r = pinned(&e, SimFlavor::Sglang, path, body, rank).await;
        assert_eq!(
            r.status,
            StatusCode::OK,
            "{path}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert!(shaped(&r.json()), "{path}: {}", r.json());
        assert_eq!(served_by(&r), rank, "{path}");
        assert_eq!(
            e.seen().last().unwrap().body_rank,
            Some(json!(rank)),
            "{path}"
        );
    }

    // The older field name pins too, and the native /generate streams SGLang's way.
    let body = json!({"text": "hi", "sampling_params": {"max_new_tokens": 2}, "stream": true,
        "data_parallel_rank": 3});
    let r = post_json(e.addr, "/generate", body).await;
    assert_eq!(served_by(&r), 3);
    let (events, data) = sse(&r);
    assert!(events.is_empty());
    assert_eq!(data.last().unwrap(), "[DONE]");
    let last: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(last["text"], "t0 t1 ");
    assert_eq!(last["meta_info"]["finish_reason"]["length"], 2);
}

#[tokio::test]
async fn sglang_describes_itself() {
    let e = engine(SimConfig {
        models: vec!["alpha".into(), "beta".into()],
        ..sim(SimFlavor::Sglang, 4, 0)
    })
    .await;
    for path in ["/server_info", "/get_server_info"] {
        let v = get(e.addr, path).await.json();
        assert_eq!(v["dp_size"], 4, "{path}");
        assert_eq!(v["tp_size"], 1, "{path}");
        assert_eq!(v["model_path"], "alpha", "{path}");
    }
    for path in ["/model_info", "/get_model_info"] {
        let v = get(e.addr, path).await.json();
        assert_eq!(v["model_path"], "alpha", "{path}");
        assert_eq!(v["tokenizer_path"], "alpha", "{path}");
        assert_eq!(v["is_generation"], true, "{path}");
    }
    assert_eq!(get(e.addr, "/v1/models/beta").await.json()["id"], "beta");
    let missing = get(e.addr, "/v1/models/gamma").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(missing.json()["error"]["code"], "model_not_found");

    // vLLM serves none of these.
    let v = engine(sim(SimFlavor::Vllm, 1, 0)).await;
    for path in ["/server_info", "/get_model_info", "/v1/models/tiny-llama"] {
        assert_eq!(
            get(v.addr, path).await.status,
            StatusCode::NOT_FOUND,
            "{path}"
        );
    }
}

#[tokio::test]
async fn fault_knobs_reach_the_new_endpoints() {
    let e = engine(sim(SimFlavor::Vllm, 2, 0)).await;
    e.set_fail(503, 100.0).unwrap();
    for path in ["/v1/responses", "/v1/rerank", "/tokenize", "/v1/messages"] {
        let r = post_json(e.addr, path, json!({"input": "x"})).await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{path}");
    }
    assert_eq!(e.requests_received(), 4);
    assert!(e.seen().is_empty(), "failed before the pin was read");
}
