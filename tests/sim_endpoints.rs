//! The simulated engine's HTTP surface over real sockets: served models, API keys, what it
//! records of each request, and every endpoint it imitates, answered by the rank it was pinned to.

mod common;

use bytes::Bytes;
use common::{engine, get, post, post_json, send, sim, Reply};
use http::StatusCode;
use http_body_util::Full;
use rankgate_sim::sim::{SimConfig, SimEngine, SimFlavor};
use serde_json::{json, Value};

fn two_models(flavor: SimFlavor) -> SimConfig {
    SimConfig {
        models: vec!["alpha".into(), "beta".into()],
        ..sim(flavor, 2, 0)
    }
}

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

/// One endpoint to try: its path, a request body, and a check of the answer's shape.
type Case = (&'static str, Value, fn(&Value) -> bool);

/// POSTs `body` pinned to global rank `rank` the way `flavor` is pinned by a router: vLLM by
/// header, SGLang by body field.
async fn pinned(e: &SimEngine, flavor: SimFlavor, path: &str, mut body: Value, rank: u32) -> Reply {
    let mut req = post(e.addr, path);
    match flavor {
        SimFlavor::Vllm => req = req.header("x-data-parallel-rank", rank.to_string()),
        SimFlavor::Sglang => body["routed_dp_rank"] = json!(rank),
    }
    send(req.body(Full::new(Bytes::from(body.to_string()))).unwrap()).await
}

fn served_by(r: &Reply) -> u32 {
    r.headers["x-sim-rank"].to_str().unwrap().parse().unwrap()
}

/// The `event:` names of an SSE body, and its `data:` payloads.
fn sse(r: &Reply) -> (Vec<String>, Vec<String>) {
    let text = String::from_utf8_lossy(&r.body);
    let mut events = Vec::new();
    let mut data = Vec::new();
    for line in text.lines() {
        if let Some(e) = line.strip_prefix("event: ") {
            events.push(e.to_string());
        } else if let Some(d) = line.strip_prefix("data: ") {
            data.push(d.to_string());
        }
    }
    (events, data)
}

#[tokio::test]
async fn vllm_endpoints_answer_in_shape_on_the_pinned_rank() {
    let e = engine(two_models(SimFlavor::Vllm)).await;
    let m = "beta";
    let mut cases: Vec<Case> = vec![
        (
            "/v1/responses",
            json!({"model": m, "input": "hi", "max_output_tokens": 3}),
            |v| {
                v["object"] == "response"
                    && v["status"] == "completed"
                    && v["id"].as_str().unwrap().starts_with("resp_")
                    && v["output"][0]["content"][0]["type"] == "output_text"
                    && v["usage"]["output_tokens"] == 3
            },
        ),
        (
            "/v1/messages",
            json!({"model": m, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
            |v| {
                v["type"] == "message"
                    && v["role"] == "assistant"
                    && v["id"].as_str().unwrap().starts_with("msg_")
                    && v["content"][0]["type"] == "text"
                    && v["content"][0]["text"] == "t0 t1 "
            },
        ),
        (
            "/tokenize",
            json!({"model": m, "prompt": "twelve chars"}),
            |v| {
                v["count"] == 3
                    && v["tokens"].as_array().unwrap().len() == 3
                    && v["max_model_len"] == 4096
            },
        ),
        (
            "/detokenize",
            json!({"model": m, "tokens": [1000, 1001]}),
            |v| v["prompt"] == "t0 t1 ",
        ),
        ("/pooling", json!({"model": m, "input": "x"}), |v| {
            v["object"] == "list" && v["data"][0]["object"] == "pooling"
        }),
        ("/classify", json!({"model": m, "input": "x"}), |v| {
            v["data"][0]["label"].is_string() && v["data"][0]["probs"].is_array()
        }),
    ];
    let rerank: fn(&Value) -> bool = |v| {
        let r = v["results"].as_array().unwrap();
        r.len() == 2
            && r[0]["index"] == 0
            && r[1]["document"]["text"] == "b"
            && r[0]["relevance_score"].as_f64() > r[1]["relevance_score"].as_f64()
    };
    let score: fn(&Value) -> bool = |v| {
        v["object"] == "list"
            && v["data"][0]["object"] == "score"
            && v["data"][0]["score"].is_number()
    };
    for path in ["/v1/rerank", "/rerank", "/v2/rerank"] {
        cases.push((
            path,
            json!({"model": m, "query": "q", "documents": ["a", "b"]}),
            rerank,
        ));
    }
    for path in ["/v1/score", "/score"] {
        cases.push((
            path,
            json!({"model": m, "text_1": "q", "text_2": ["a"]}),
            score,
        ));
    }
    for (i, (path, body, shaped)) in cases.into_iter().enumerate() {
        let rank = (i % 2) as u32;
        let r = pinned(&e, SimFlavor::Vllm, path, body, rank).await;
        assert_eq!(
            r.status,
            StatusCode::OK,
            "{path}: {}",
            String::from_utf8_lossy(&r.body)
        );
        let v = r.json();
        assert!(shaped(&v), "{path}: {v}");
        assert_eq!(served_by(&r), rank, "{path}");
        if v.get("model").is_some() {
            assert_eq!(v["model"], m, "{path}");
        }
        let seen = e.seen();
        let s = seen.last().unwrap();
        assert_eq!(
            (s.path.as_str(), s.rank, s.model.as_deref()),
            (path, rank, Some(m))
        );
    }
}

#[tokio::test]
async fn vllm_streams_responses_and_messages() {
    let e = engine(sim(SimFlavor::Vllm, 2, 0)).await;
    let r = pinned(
        &e,
        SimFlavor::Vllm,
        "/v1/responses",
        json!({"input": "hi", "max_output_tokens": 2, "stream": true}),
        1,
    )
    .await;
    assert_eq!(r.headers["content-type"], "text/event-stream");
    assert_eq!(served_by(&r), 1);
    let (events, data) = sse(&r);
    assert_eq!(
        events,
        [
            "response.created",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.completed"
        ]
    );
    let done: Value = serde_json::from_str(data.last().unwrap()).unwrap();
    assert_eq!(done["response"]["status"], "completed");
    assert_eq!(done["response"]["model"], "tiny-llama");
    assert_eq!(
        done["response"]["output"][0]["content"][0]["text"],
        "t0 t1 "
    );

    let r = pinned(
        &e,
        SimFlavor::Vllm,
        "/v1/messages",
        json!({"max_tokens": 1, "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
        0,
    )
    .await;
    assert_eq!(served_by(&r), 0);
    let (events, _) = sse(&r);
    assert_eq!(
        events,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
}

#[tokio::test]
async fn messages_errors_are_anthropic_shaped() {
    let e = engine(sim(SimFlavor::Vllm, 2, 0)).await;
    let body = json!({"model": "nope", "max_tokens": 1, "messages": []});
    let r = post_json(e.addr, "/v1/messages", body).await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(
        r.json(),
        json!({"type": "error", "error": {"type": "NotFoundError",
        "message": "The model `nope` does not exist."}})
    );
}

fn transcription(boundary: &str, model: Option<&str>, file: bool) -> Bytes {
    let mut b = String::new();
    if let Some(m) = model {
        b += &format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{m}\r\n"
        );
    }
    if file {
        b += &format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; \
            filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF....WAVE\r\n"
        );
    }
    b += &format!("--{boundary}--\r\n");
    Bytes::from(b)
}

async fn post_form(e: &SimEngine, path: &str, body: Bytes, rank: Option<u32>) -> Reply {
    let mut req = http::Request::post(format!("http://{}{path}", e.addr))
        .header("content-type", "multipart/form-data; boundary=sim-b0undary");
    if let Some(r) = rank {
        req = req.header("x-data-parallel-rank", r.to_string());
    }
    send(req.body(Full::new(body)).unwrap()).await
}

#[tokio::test]
async fn audio_reads_the_model_from_the_form() {
    let e = engine(two_models(SimFlavor::Vllm)).await;
    for path in ["/v1/audio/transcriptions", "/v1/audio/translations"] {
        let r = post_form(
            &e,
            path,
            transcription("sim-b0undary", Some("beta"), true),
            Some(1),
        )
        .await;
        assert_eq!(
            r.status,
            StatusCode::OK,
            "{}",
            String::from_utf8_lossy(&r.body)
        );
        assert!(r.json()["text"].is_string());
        assert_eq!(served_by(&r), 1);
        let seen = e.seen();
        assert_eq!(seen.last().unwrap().model.as_deref(), Some("beta"));
    }
    let path = "/v1/audio/transcriptions";
    let r = post_form(
        &e,
        path,
        transcription("sim-b0undary", Some("gamma"), true),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = post_form(&e, path, transcription("sim-b0undary", None, true), None).await;
    assert_eq!(r.status, StatusCode::OK, "no model field: the default");
    let r = post_form(
        &e,
        path,
        transcription("sim-b0undary", Some("beta"), false),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "no file part");
}

#[tokio::test]
async fn max_completion_tokens_is_the_newer_max_tokens() {
    for flavor in [SimFlavor::Vllm, SimFlavor::Sglang] {
        let e = engine(sim(flavor, 1, 0)).await;
        let chat = json!({"messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 9, "max_completion_tokens": 3});
        let r = post_json(e.addr, "/v1/chat/completions", chat).await.json();
        assert_eq!(r["usage"]["completion_tokens"], 3);
        assert_eq!(r["choices"][0]["message"]["content"], "t0 t1 t2 ");
        let r = post_json(
            e.addr,
            "/v1/completions",
            json!({"prompt": "hi", "max_completion_tokens": 2}),
        )
        .await
        .json();
        assert_eq!(r["usage"]["completion_tokens"], 2);
        let r = post_json(
            e.addr,
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 4}),
        )
        .await
        .json();
        assert_eq!(r["usage"]["completion_tokens"], 4);
    }
}

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
