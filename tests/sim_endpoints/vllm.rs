//! The vLLM endpoints the simulated engine imitates, answered in shape on the rank a request was
//! pinned to: streamed Responses and Messages, Anthropic-shaped errors, audio reading the model
//! from its form, and `max_completion_tokens` as the newer `max_tokens`.

use bytes::Bytes;
use http::StatusCode;
use http_body_util::Full;
use rankgate_sim::sim::{SimEngine, SimFlavor};
use serde_json::{json, Value};

use crate::common::{engine, post_json, send, sim, Reply};
use crate::helpers::*;

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
