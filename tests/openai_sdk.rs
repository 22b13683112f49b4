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

/// `rankgate openai-client` under the default `expose_worker = "none"`: with the admin token
/// each proxied call names the rank that served it (rankgate's own answers say so); without it
/// the tool says the router hides the rank, never `worker=-`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_client_names_the_rank_with_the_admin_token() {
    use common::admin::{token_env, TOKEN};
    let e = engine(serving(&["tiny-llama"], 2, 0)).await;
    let server = format!("expose_worker = \"none\"\n{}", token_env());
    let r = router_with(&server, FAST, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    wait_models(&r).await;
    let base = format!("http://{}", r.addr);
    let run = |token| {
        let args = [
            "openai-client",
            "--model",
            "tiny-llama",
            "--base-url",
            &base,
        ];
        common::binary::run_tool(args.map(String::from).to_vec(), token)
    };
    let o = run(Some(TOKEN)).await;
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let line = |name: &str| {
        (out.lines().find(|l| l.starts_with(name)))
            .unwrap_or_else(|| panic!("no {name} line:\n{out}"))
            .to_string()
    };
    let chat = line("chat.completions.create ");
    assert!(chat.contains(&format!("worker={}@", e.url())), "{out}");
    let listed = line("models.list");
    assert!(listed.contains("answered by the router itself"), "{out}");
    assert!(!out.contains("worker=-"), "{out}");

    let o = run(None).await;
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(!out.contains(&e.url()), "the rank stays hidden: {out}");
    assert!(!out.contains("worker=-"), "{out}");
    let chat = (out
        .lines()
        .find(|l| l.starts_with("chat.completions.create ")))
    .unwrap_or_default();
    assert!(chat.contains("hidden by the router"), "{out}");
    r.shutdown().await;
}
