//! The `openai` SDK's first requests (`rankgate_sim::load::sdk`, what `rankgate openai-client`
//! sends), against a router in front of two engines serving different models: every call is
//! answered as one engine would answer it, by an engine serving the model.

mod common;

use rankgate_sim::load::sdk;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdks_calls_get_what_one_engine_would_answer() {
    let (a, b, r) = two_models().await;
    let client = client();
    let base = format!("http://{}", r.addr);
    for call in sdk::calls("model-b") {
        let o = sdk::send(&client, &base, "EMPTY", &call)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", call.name));
        assert!(
            o.status.is_success(),
            "{}: {} {}",
            call.name,
            o.status,
            String::from_utf8_lossy(&o.body)
        );
        assert!(o.request_id.is_some(), "{}: no x-request-id", call.name);
        // Proxied calls name their rank, always one of model-b's engine.
        if let Some(w) = &o.worker {
            assert!(w.starts_with(&b.url()), "{}: served by {w}", call.name);
        }
        match call.name {
            "chat.completions.create(stream=True)" => {
                let text = String::from_utf8_lossy(&o.body);
                assert!(text.contains("data: [DONE]"), "{text}");
            }
            "models.list" => {
                let v = o.json().unwrap();
                assert_eq!(v["data"].as_array().unwrap().len(), 2, "{v}");
            }
            "models.retrieve" => assert_eq!(o.json().unwrap()["id"], "model-b"),
            _ => assert!(o.json().is_some(), "{}: not JSON", call.name),
        }
    }
    assert!(
        a.seen().is_empty(),
        "nothing reached the engine without model-b"
    );
}
