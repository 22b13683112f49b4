//! `top`'s poll-and-render loop headless against a live router: engines serve, die and leave
//! the fleet, the router goes away; and the recorded `/workers` fixture's recorder.

use super::*;

fn ids_of(rows: &[Value], engine: &str) -> Vec<String> {
    rows.iter()
        .filter(|r| r["engine"] == engine)
        .map(|r| r["id"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_fleet_through_engines_leaving_and_the_router_going() {
    let a = engine(serving(&["model-a"], 2, 0)).await;
    let b = engine(serving(&["model-b"], 2, 2)).await;
    a.set_kv_usage(vec![0.4, 0.2]);
    b.set_kv_usage(vec![0.8, 0.1]);
    let extra = format!("{}{FAST}", token_env());
    let r = router(
        &extra,
        &[
            engine_toml(&a.url(), "vllm", 2, 0),
            engine_toml(&b.url(), "vllm", 2, 2),
        ],
    )
    .await;
    let rows = wait_state(&r, &[0, 1, 2, 3], "available").await;
    let (a_ids, b_ids) = (ids_of(&rows, &a.url()), ids_of(&rows, &b.url()));
    wait_models(&r).await;

    let mut top = Top::new(
        &format!("http://{}", r.admin_addr),
        Duration::from_millis(200),
    )
    .expect("admin url");
    let mut term = terminal(80, 24);
    top.poll_once().await;
    let first = draw(top.state(), &mut term);
    assert!(!top.state().stale(), "{first}");
    // One reading of the counters: no rate yet.
    assert_eq!(top.state().totals().req_per_s, None, "{first}");

    // Traffic for both models between two polls: every rank that served shows a rate.
    for i in 0..24 {
        let model = if i % 2 == 0 { "model-a" } else { "model-b" };
        let body = serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        });
        let reply = send(
            post(r.addr, "/v1/chat/completions")
                .body(Full::new(Bytes::from(body.to_string())))
                .unwrap(),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    }
    top.poll_once().await;
    let text = draw(top.state(), &mut term);
    for id in a_ids.iter().chain(&b_ids) {
        assert!(text.contains(&short_id(id, 18)), "{id} missing:\n{text}");
    }
    let totals = top.state().totals();
    assert!(
        totals.req_per_s.is_some_and(|x| x > 0.0),
        "{totals:?}\n{text}"
    );
    let header = text.lines().next().unwrap();
    assert!(header.contains("ranks 4/4"), "{header}");
    assert!(!header.contains("req/s 0.0"), "{header}");
    assert!(header.contains(&r.admin_addr.to_string()), "{header}");

    // B dies: its ranks turn unavailable on the screen, with a reason, and nothing panics.
    b.kill().await;
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows.iter()
            .filter(|w| w["engine"] == b.url())
            .all(|w| w["telemetry"] == "unavailable")
    })
    .await;
    top.poll_once().await;
    let text = draw(top.state(), &mut term);
    for row in top.state().rows() {
        let line = text
            .lines()
            .find(|l| l.starts_with(&short_id(&row.id, 18)))
            .unwrap_or_else(|| panic!("{} missing:\n{text}", row.id));
        if row.engine == b.url() {
            assert!(!row.available() && row.reason.is_some(), "{row:?}");
            assert!(!line.contains(" ok "), "{line}");
        } else {
            assert!(line.contains(" ok "), "{line}");
        }
    }
    assert!(text.lines().next().unwrap().contains("ranks 2/4"), "{text}");

    // B leaves the fleet through the admin API: its rows go.
    let delete = Request::builder()
        .method(Method::DELETE)
        .uri(format!("http://{}/engines?url={}", r.admin_addr, b.url()))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let reply = send(delete).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    top.poll_once().await;
    let text = draw(top.state(), &mut term);
    assert_eq!(top.state().rows().len(), 2, "{text}");
    for id in &b_ids {
        assert!(
            !text.contains(&short_id(id, 18)),
            "{id} still shown:\n{text}"
        );
    }
    for id in &a_ids {
        assert!(text.contains(&short_id(id, 18)), "{id} missing:\n{text}");
    }

    // The router goes: the status line says so, the last rows stay, twice over.
    r.shutdown().await;
    for polls in 1..=2 {
        top.poll_once().await;
        let text = draw(top.state(), &mut term);
        let status = text.lines().nth(1).unwrap();
        assert!(top.state().stale(), "{text}");
        assert!(status.contains("admin unreachable"), "{text}");
        assert!(status.contains("stale"), "{text}");
        assert_eq!(top.state().outage.as_ref().unwrap().failures, polls);
        for id in &a_ids {
            assert!(text.contains(&short_id(id, 18)), "{id} missing:\n{text}");
        }
    }
    drop(a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_listening_and_not_an_admin() {
    // A port nothing listens on: unreachable from the first poll, no data, no panic.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let mut top = Top::new(&addr.to_string(), Duration::from_secs(1)).unwrap();
    top.poll_once().await;
    let text = draw(top.state(), &mut terminal(80, 24));
    assert!(text.contains("admin unreachable: "), "{text}");
    assert!(text.contains("no data yet"), "{text}");

    // The front door instead of the admin listener: refused as such, not drawn as a fleet.
    let (_e, r) = fleet(sim(SimFlavor::Vllm, 1, 0)).await;
    let mut top = Top::new(&format!("http://{}", r.addr), Duration::from_secs(1)).unwrap();
    top.poll_once().await;
    let text = draw(top.state(), &mut terminal(80, 24));
    assert!(top.state().stale(), "{text}");
    assert!(top.state().rows().is_empty(), "{text}");
    r.shutdown().await;
}

/// Records `tests/fixtures/workers.json` from a live fleet: a vLLM engine with two ranks, an
/// SGLang one with four (one of them missing from its `/metrics`), and an engine that is down;
/// a few streams are open while it is read, so ranks show running and in-flight requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes tests/fixtures/workers.json; run by hand to record a new one"]
async fn record_workers_fixture() {
    let a = engine(serving(&["meta-llama/Llama-3.1-8B-Instruct"], 2, 0)).await;
    let b = engine(rankgate_sim::sim::SimConfig {
        models: vec!["Qwen/Qwen2.5-7B-Instruct".into()],
        ..sim(SimFlavor::Sglang, 4, 2)
    })
    .await;
    a.set_kv_usage(vec![0.62, 0.18]);
    b.set_kv_usage(vec![0.93, 0.41, 0.77, 0.05]);
    b.set_dark_ranks(vec![5]);
    let down = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let down_url = format!("http://{}", down.local_addr().unwrap());
    drop(down);
    let r = router(
        FAST,
        &[
            engine_toml(&a.url(), "vllm", 2, 0),
            engine_toml(&b.url(), "sglang", 4, 2),
            engine_toml(&down_url, "vllm", 1, 6),
        ],
    )
    .await;
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows.iter()
            .filter(|w| w["telemetry"] == "available")
            .count()
            == 5
            && rows.iter().all(|w| w["reason_kind"] != "not_polled")
            && (rows.iter().filter(|w| w["engine"] != down_url.as_str()))
                .all(|w| w["models"].as_array().is_some_and(|m| !m.is_empty()))
    })
    .await;
    let mut streams = Vec::new();
    for model in [
        "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.1-8B-Instruct",
        "Qwen/Qwen2.5-7B-Instruct",
    ] {
        let body = serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 4000,
            "stream": true,
        });
        let s = client()
            .request(
                post(r.addr, "/v1/chat/completions")
                    .body(Full::new(Bytes::from(body.to_string())))
                    .unwrap(),
            )
            .await
            .expect("stream");
        assert_eq!(s.status(), StatusCode::OK);
        streams.push(s);
    }
    let rows = wait_workers(&r, Duration::from_secs(10), |rows| {
        let sum = |key: &str| rows.iter().filter_map(|w| w[key].as_u64()).sum::<u64>();
        sum("in_flight") == 3 && sum("num_running_reqs") >= 2
    })
    .await;
    let text = serde_json::to_string_pretty(&rows).unwrap() + "\n";
    std::fs::write(fixture("workers.json"), text).unwrap();
    drop(streams);
    r.shutdown().await;
}
