//! Model-aware routing over real sockets: two simulated engines serving different models behind
//! one router. Every request reaches an engine that serves its model, and within that set the
//! least-KV rank; the fleet's `/v1/models` is the union; engine keys replace the client's.

mod common;

use bytes::Bytes;
use http_body_util::Full;
use rankgate_sim::sim::{SimConfig, SimFlavor};
use serde_json::{json, Value};

use common::recorded::RecordedVllm;
use common::*;

fn chat_for(model: Option<&str>) -> Value {
    let mut v = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    if let Some(m) = model {
        v["model"] = json!(m);
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_model_goes_only_to_its_engines_and_their_least_loaded_rank() {
    let (a, b, r) = two_models().await;
    for (model, want_rank) in [("model-a", 1), ("model-b", 2)] {
        let mut on_best = 0;
        for _ in 0..100 {
            let reply = post_json(r.addr, "/v1/chat/completions", chat_for(Some(model))).await;
            assert_eq!(
                reply.status,
                200,
                "{}",
                String::from_utf8_lossy(&reply.body)
            );
            on_best += reply.worker().ends_with(&format!("@{want_rank}")) as u32;
        }
        assert!(on_best >= 90, "{model}: {on_best}/100 on rank {want_rank}");
    }
    for (e, model) in [(&a, "model-a"), (&b, "model-b")] {
        let seen = e.seen();
        assert_eq!(seen.len(), 100, "each engine got its own model's 100");
        assert!(seen.iter().all(|s| s.model.as_deref() == Some(model)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_or_missing_models_are_the_clients_error() {
    let (a, b, r) = two_models().await;
    let reply = post_json(r.addr, "/v1/chat/completions", chat_for(Some("model-z"))).await;
    assert_eq!(reply.status, 404);
    let err = &reply.json()["error"];
    assert_eq!(err["code"], "model_not_found");
    assert_eq!(err["param"], "model");
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("model-z") && msg.contains("model-a, model-b"),
        "{msg}"
    );

    let reply = post_json(r.addr, "/v1/chat/completions", chat_for(None)).await;
    assert_eq!(reply.status, 400, "several models and none named");

    let reply = post_json(r.addr, "/v1/chat/completions", json!({"model": 7})).await;
    assert_eq!(reply.status, 400);
    let reply = send(
        post(r.addr, "/v1/chat/completions")
            .body(Full::new(Bytes::from_static(b"{\"model\": \"model-a\"")))
            .unwrap(),
    )
    .await;
    // The scan reads the object's top level to its end (a later `model` would count): a cut
    // body is refused before any engine sees it.
    assert_eq!(reply.status, 400);
    assert!(reply.headers.get("x-rankgate-worker").is_none());
    assert!(String::from_utf8_lossy(&reply.body).contains("not valid JSON"));
    assert!(a.seen().is_empty() && b.seen().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleets_models_are_the_union_of_its_engines() {
    let (_a, _b, r) = two_models().await;
    let list = get(r.addr, "/v1/models").await;
    assert_eq!(list.status, 200);
    let ids: Vec<String> = list.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, ["model-a", "model-b"]);
    let one = get(r.addr, "/v1/models/model-b").await;
    assert_eq!(one.status, 200);
    assert_eq!(one.json()["id"], "model-b");
    let none = get(r.addr, "/v1/models/model-z").await;
    assert_eq!(none.status, 404);
    assert_eq!(none.json()["error"]["code"], "model_not_found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_fixed_in_the_config_routes_without_asking_the_engine() {
    let a = engine(serving(&["model-a"], 1, 0)).await;
    let b = engine(serving(&["model-b"], 1, 1)).await;
    // B's /v1/models never answers; the config says what it serves.
    b.set_hang_models(true);
    let r = router(
        FAST,
        &[
            engine_toml(&a.url(), "vllm", 1, 0),
            engine_toml(&b.url(), "vllm", 1, 1) + "models = [\"model-b\"]\n",
        ],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    wait_models(&r).await;
    for _ in 0..10 {
        let reply = post_json(r.addr, "/v1/chat/completions", chat_for(Some("model-b"))).await;
        assert_eq!(reply.status, 200);
        assert!(reply.worker().ends_with("@1"));
    }
    assert!(a.seen().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_gets_its_own_key_never_the_clients() {
    const VAR: &str = "RANKGATE_TEST_ENGINE_KEY_MODELS";
    // A name no other test uses: set once, before the router reads it.
    std::env::set_var(VAR, "engine-secret");
    let e = engine(SimConfig {
        api_key: Some("engine-secret".into()),
        ..sim(SimFlavor::Vllm, 2, 0)
    })
    .await;
    let r = router(
        FAST,
        &[engine_toml(&e.url(), "vllm", 2, 0) + &format!("api_key_env = \"{VAR}\"\n")],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    // The engine guards /v1/models with its key: the list arriving means polls carry it.
    wait_models(&r).await;
    let reply = send(
        post(r.addr, "/v1/chat/completions")
            .header("authorization", "Bearer client-key")
            .body(Full::new(Bytes::from(chat_body(1, false))))
            .unwrap(),
    )
    .await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let seen = e.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].authorization.as_deref(),
        Some("Bearer engine-secret")
    );

    // Without rankgate's key the same engine refuses: the key is what made it work.
    let direct = send(
        http::Request::post(format!("{}/v1/chat/completions", e.url()))
            .header("authorization", "Bearer client-key")
            .body(Full::new(Bytes::from(chat_body(1, false))))
            .unwrap(),
    )
    .await;
    assert_eq!(direct.status, 401);
}

#[tokio::test]
async fn an_engine_key_variable_that_is_unset_is_a_config_error() {
    let text = "[[engines]]\nurl = \"http://127.0.0.1:1\"\nflavor = \"vllm\"\napi_key_env = \"RANKGATE_TEST_UNSET_VARIABLE\"\n";
    let err = rankgate::config::Config::from_str(text)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("engines[0].api_key_env") && err.contains("RANKGATE_TEST_UNSET_VARIABLE"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_audio_form_goes_to_the_engine_serving_its_model_field() {
    let (a, b, r) = two_models().await;
    let form = "--rg\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
                Content-Type: audio/wav\r\n\r\nRIFF....\r\n--rg\r\n\
                Content-Disposition: form-data; name=\"model\"\r\n\r\nmodel-b\r\n--rg--\r\n";
    for _ in 0..10 {
        let reply = send(
            http::Request::post(format!("http://{}/v1/audio/transcriptions", r.addr))
                .header("content-type", "multipart/form-data; boundary=rg")
                .body(Full::new(Bytes::from_static(form.as_bytes())))
                .unwrap(),
        )
        .await;
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        assert!(reply.worker().starts_with(&b.url()), "{}", reply.worker());
    }
    assert!(a.seen().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_named_twice_routes_by_the_last_as_the_engine_reads_it() {
    let (a, b, r) = two_models().await;
    let body = r#"{"model":"model-a","messages":[{"role":"user","content":"hi"}],"max_tokens":1,"model":"model-b"}"#;
    let reply = send(
        post(r.addr, "/v1/chat/completions")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap(),
    )
    .await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert!(reply.worker().starts_with(&b.url()), "{}", reply.worker());
    assert!(a.seen().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_native_sglang_request_without_model_goes_to_the_one_sglang_model() {
    let v = engine(serving(&["model-a"], 1, 0)).await;
    let s = engine(SimConfig {
        models: vec!["model-s".into()],
        ..sim(SimFlavor::Sglang, 1, 1)
    })
    .await;
    let r = router(
        FAST,
        &[
            engine_toml(&v.url(), "vllm", 1, 0),
            engine_toml(&s.url(), "sglang", 1, 1),
        ],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    wait_models(&r).await;
    // Only SGLang serves /generate, and it serves one model: no need to name it.
    let generate = json!({"text": "hi", "sampling_params": {"max_new_tokens": 1}});
    let reply = post_json(r.addr, "/generate", generate).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert!(reply.worker().starts_with(&s.url()));
    // Chat is served by both flavors, so there it must be named.
    assert_eq!(
        post_json(r.addr, "/v1/chat/completions", chat_for(None))
            .await
            .status,
        400
    );
}

/// A model no known list has, while the only engines that might serve it (their lists are not
/// known: this one never answers) have no routable rank: 503 that says so and names the model,
/// not a bare "no routable rank".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_model_waiting_on_unknown_lists_is_named_in_the_503() {
    let (mute_url, held) = common::mute_engine().await;
    let e = common::engine(common::sim(rankgate_sim::sim::SimFlavor::Vllm, 1, 0)).await;
    let r = common::router(
        "[telemetry]\ninterval = \"50ms\"\nstale_after = \"2s\"\ntimeout = \"300ms\"\n",
        &[
            format!(
                "[[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\ndp_size = 1\n",
                e.url()
            ),
            format!("[[engines]]\nurl = \"{mute_url}\"\nflavor = \"vllm\"\ndp_size = 1\n"),
        ],
    )
    .await;
    common::wait_workers(&r, std::time::Duration::from_secs(10), |rows| {
        rows.iter()
            .any(|w| w["engine"] == e.url() && w["models"] == serde_json::json!(["tiny-llama"]))
    })
    .await;
    let body =
        serde_json::json!({"model": "not-served", "messages": [{"role": "user", "content": "hi"}]});
    let reply = common::send(
        common::post(r.addr, "/v1/chat/completions")
            .body(http_body_util::Full::new(bytes::Bytes::from(
                body.to_string(),
            )))
            .unwrap(),
    )
    .await;
    assert_eq!(reply.status, 503);
    let message = reply.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        message.contains("model `not-served`") && message.contains("not known yet"),
        "{message}"
    );
    // The model the known engine serves still goes there.
    assert_eq!(common::chat(r.addr, 2).await.status, 200);
    r.shutdown().await;
    held.abort();
}

/// The body of a capture in tests/fixtures/vllm-0.32-lora/ (status and type lines first).
fn captured(text: &str) -> &str {
    text.split_once("\n\n")
        .map_or(text, |(_, body)| body)
        .trim()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_loaded_on_the_engine_serves_from_its_first_request_through_rankgate() {
    let e = RecordedVllm::start().await;
    let r = router(FAST, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    wait_models(&r).await;
    // The adapter is loaded straight on the engine (vLLM's /v1/load_lora_adapter), long before
    // the router's periodic read of its list comes round.
    e.set_models(captured(include_str!(
        "fixtures/vllm-0.32-lora/models-after-load.txt"
    )));
    let before = e.model_reads();
    let reply = post_json(r.addr, "/v1/chat/completions", chat_for(Some("chat-lora"))).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert!(e.model_reads() > before, "the list was not read again");
    let listed = get(r.addr, "/v1/models").await.json();
    let lora = (listed["data"].as_array().unwrap().iter())
        .find(|m| m["id"] == "chat-lora")
        .unwrap_or_else(|| panic!("chat-lora not listed: {listed}"));
    assert_eq!(lora["parent"], "tiny-llama");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_models_read_the_lists_again_at_most_once_a_second() {
    let e = RecordedVllm::start().await;
    let r = router(FAST, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    wait_models(&r).await;
    let before = e.model_reads();
    // A burst of mistyped names: one round reads the list once, and every one gets the 404.
    let burst: Vec<_> = (0..20)
        .map(|i| {
            let addr = r.addr;
            tokio::spawn(async move {
                post_json(
                    addr,
                    "/v1/chat/completions",
                    chat_for(Some(&format!("typo-{i}"))),
                )
                .await
            })
        })
        .collect();
    for reply in burst {
        let reply = reply.await.unwrap();
        assert_eq!(
            reply.status,
            404,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        assert_eq!(reply.json()["error"]["code"], "model_not_found");
    }
    let after_burst = e.model_reads();
    assert!(
        (1..=2).contains(&(after_burst - before)),
        "{} reads for one burst",
        after_burst - before
    );
    // Within a second of that round the lists are fresh: answered at once, nothing read.
    let t0 = std::time::Instant::now();
    let reply = post_json(r.addr, "/v1/chat/completions", chat_for(Some("typo-again"))).await;
    assert_eq!(reply.status, 404);
    if t0.elapsed() < rankgate::recheck::MIN_GAP / 2 {
        assert_eq!(e.model_reads(), after_burst);
    }
}
