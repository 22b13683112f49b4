//! Which failures count against a rank: an engine answering 503 while its `/metrics` look fine is
//! ejected then readmitted, a failing `/health` gets no traffic, the retry budget caps extra load
//! when everything fails, transport failures eject the whole engine, and a 4xx never counts.

use std::time::Duration;

use rankgate_sim::sim::{SimConfig, SimFlavor as Flavor};
use serde_json::Value;
use tokio::time::{timeout, Instant};

use super::helpers::*;
use crate::common::*;

/// 4. An engine answering 503 to everything while its `/metrics` look idle: clients still
/// succeed (failover), its ranks are ejected, and once it recovers a trial re-admits them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_engine_is_ejected_then_readmitted() {
    let (bad, good) = (engine(vllm(2, 0)).await, engine(vllm(2, 2)).await);
    let r = router(
        &format!("[routing]\neject_after = 3\neject_for = \"300ms\"\n{FAST}"),
        &[toml_of(&bad, 2, 0), toml_of(&good, 2, 2)],
    )
    .await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    // The good engine looks busy, the bad one idle: least_kv prefers the bad one.
    good.set_kv_usage(vec![0.9, 0.9]);
    wait_workers(&r, SOON, |rows| rows[2]["kv_usage"] == 0.9).await;
    bad.set_fail(503, 100.0).unwrap();
    let started = Instant::now();
    let mut sent = 0;
    let ejected = |rows: &[Value]| rows[..2].iter().all(|w| w["reason_kind"] == "ejected");
    let rows = loop {
        let reply = chat(r.addr, 1).await;
        sent += 1;
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        assert!(is_on(&reply.worker(), &good), "{}", reply.worker());
        let rows = workers(&r).await;
        if ejected(&rows) {
            break rows;
        }
        assert!(sent < 20, "not ejected after {sent} requests: {rows:#?}");
    };
    let to_eject = started.elapsed();
    for w in rows_of(&rows, &bad) {
        assert_eq!(w["telemetry"], "unavailable");
        assert!(
            reason(w).starts_with("ejected: 3 consecutive 503 (for 300 ms"),
            "{w}"
        );
        let id = w["id"].as_str().unwrap();
        assert_eq!(
            metric(&r, &format!("rankgate_rank_ejected{{worker=\"{id}\"}}")).await,
            1.0
        );
        assert_eq!(
            metric(&r, &format!("rankgate_ejections_total{{worker=\"{id}\"}}")).await,
            1.0
        );
    }
    assert_eq!(bad.requests_received(), 6, "3 failures per rank, no more");
    let retries = r.metrics.retries_total();

    // Still failing when the ejection runs out: the trial fails and the next ejection doubles.
    let mut sent_more = 0;
    loop {
        assert_eq!(chat(r.addr, 1).await.status, 200);
        sent_more += 1;
        let rows = workers(&r).await;
        if rows[..2].iter().all(|w| reason(w).contains("(for 600 ms")) {
            break;
        }
        assert!(sent_more < 400, "no doubled ejection: {rows:#?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Mended: the next trial re-admits each rank and it takes traffic again.
    bad.set_fail(503, 0.0).unwrap();
    let mended = Instant::now();
    let served_before: u64 = bad.served().iter().sum();
    let mut sent_recover = 0;
    loop {
        assert_eq!(chat(r.addr, 1).await.status, 200);
        sent_recover += 1;
        let rows = workers(&r).await;
        if rows[..2]
            .iter()
            .all(|w| w["telemetry"] == "available" && w["consecutive_failures"] == 0)
            && bad.served().iter().all(|n| *n > 0)
        {
            break;
        }
        assert!(sent_recover < 400, "not re-admitted: {rows:#?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let to_recover = mended.elapsed();
    assert!(bad.served().iter().sum::<u64>() > served_before);
    for w in ["0", "1"] {
        let s = format!("rankgate_rank_ejected{{worker=\"{}@{w}\"}}", bad.url());
        assert_eq!(metric(&r, &s).await, 0.0);
    }
    // Traffic flows to it again (it looks idle next to the busy good engine).
    let before: u64 = bad.served().iter().sum();
    for _ in 0..4 {
        assert!(is_on(&chat(r.addr, 1).await.worker(), &bad));
    }
    assert_eq!(bad.served().iter().sum::<u64>(), before + 4);
    println!(
        "503 engine: ejected after {sent} client requests in {to_eject:?} ({retries} retries, \
         all clients 200); doubled after {sent_more} more; re-admitted {to_recover:?} after \
         mending ({sent_recover} requests)"
    );
}

/// 5. `/health` answering 503 while `/metrics` look healthy: no traffic reaches the engine and its
/// ranks say why; when health returns, so does traffic.
#[tokio::test]
async fn unhealthy_engine_gets_no_traffic() {
    let sick = engine(SimConfig {
        health_status: 503,
        ..vllm(2, 0)
    })
    .await;
    let well = engine(vllm(2, 2)).await;
    let r = router(FAST, &[toml_of(&sick, 2, 0), toml_of(&well, 2, 2)]).await;
    let rows = wait_workers(&r, SOON, |rows| {
        rows[..2].iter().all(|w| w["reason_kind"] == "health")
            && rows[2..].iter().all(|w| w["telemetry"] == "available")
    })
    .await;
    for w in &rows[..2] {
        assert!(reason(w).starts_with("health: HTTP 503"), "{w}");
        // It answers (503): reachable, as `check --probe` says, and unhealthy: no traffic.
        assert_eq!(w["reachable"], true, "{w}");
        assert_eq!(w["health"], "unhealthy", "{w}");
    }
    for _ in 0..12 {
        let reply = chat(r.addr, 1).await;
        if reply.status != 200 {
            let rows = wait_workers(&r, SOON, |_| true).await;
            panic!("{:?}\n{rows:#?}", reply.body);
        }
        assert!(is_on(&reply.worker(), &well));
    }
    assert_eq!(sick.requests_received(), 0);
    assert_eq!(sick.served(), [0, 0]);
    assert!(sick.telemetry_requests() > 0, "its /metrics kept answering");

    sick.set_health_status(200).unwrap();
    wait_state(&r, &[0, 1], "available").await;
    let mut n = 0;
    while sick.served().iter().sum::<u64>() == 0 {
        assert_eq!(chat(r.addr, 1).await.status, 200);
        n += 1;
        assert!(n < 40, "a healthy engine again got no traffic");
    }
}

/// 7. A fleet answering 503 everywhere gets at most the budgeted extra load, and clients get
/// the engines' own 503 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_budget_caps_extra_load_when_everything_fails() {
    let cfg = SimConfig {
        fail_percent: 100.0,
        ..vllm(2, 0)
    };
    let a = engine(cfg.clone()).await;
    let b = engine(SimConfig {
        start_rank: 2,
        ..cfg
    })
    .await;
    let r = router(
        &format!("[routing]\neject_after = 0\n{FAST}"),
        &[toml_of(&a, 2, 0), toml_of(&b, 2, 2)],
    )
    .await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    const N: usize = 100;
    const CLIENTS: usize = 4;
    let started = Instant::now();
    let addr = r.addr;
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|_| {
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                for _ in 0..N / CLIENTS {
                    let reply = timeout(SOON, chat(addr, 1)).await.expect("no hang");
                    assert_openai_error(&reply.body, 503, Some("ServiceUnavailableError"));
                    let msg = reply.json()["error"]["message"].to_string();
                    assert!(msg.contains("simulated failure"), "not the engine's: {msg}");
                    statuses.push(reply.status.as_u16());
                }
                statuses
            })
        })
        .collect();
    for t in tasks {
        let statuses = t.await.unwrap();
        assert!(statuses.iter().all(|s| *s == 503));
    }
    let took = started.elapsed();
    let received = a.requests_received() + b.requests_received();
    let extra = received - N as u64;
    let refused = metric(&r, "rankgate_retries_refused_total").await;
    let retries = metric(&r, "rankgate_retries_total").await;
    // The budget: 20% of the requests, plus a reserve of 2/s over its 10 s window (20 retries,
    // available at once), for a test well under 10 s.
    assert!(took < Duration::from_secs(9), "{took:?}");
    let allowed = (N as f64 * 0.2) as u64 + 20;
    assert!(extra <= allowed + 2, "extra load {extra} > {allowed} (+2)");
    assert!(extra > 0, "no retry at all");
    assert_eq!(
        retries, extra as f64,
        "every retry is one extra engine request"
    );
    assert!(refused > 0.0);
    // Without the budget each request would make 3 attempts: 2N extra.
    println!(
        "retry budget: {N} requests -> {received} at the engines (+{extra}, cap {allowed}, \
         unbudgeted would be +{}); {refused} retries refused; {took:?}",
        2 * N
    );
}

/// 10. A transport failure counts against every rank of its engine: refused connections eject
/// the whole engine, each request failing over to another engine meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_failures_eject_the_whole_engine() {
    let dead = engine(vllm(2, 0)).await;
    let alive = engine(SimConfig {
        kv_usage: vec![0.85, 0.85],
        ..vllm(2, 2)
    })
    .await;
    // Polls far apart: the dead engine still looks fine when the requests meet it.
    let r = router(
        "[routing]\neject_after = 3\neject_for = \"5s\"\n\
         [telemetry]\ninterval = \"3s\"\nstale_after = \"6s\"\n",
        &[toml_of(&dead, 2, 0), toml_of(&alive, 2, 2)],
    )
    .await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    // Pinned before the first poll ends: `alive` looks busier, so least_kv picks `dead` first.
    assert_eq!(workers(&r).await[2]["kv_usage"], 0.85);
    timeout(SOON, dead.kill()).await.unwrap();
    let killed = Instant::now();
    // Only the next poll (3 s away) would see the kill; the front door finds out by itself.
    let rows = workers(&r).await;
    assert!(rows[..2].iter().all(|w| w["telemetry"] == "available"));
    let mut n = 0;
    let rows = loop {
        let reply = chat(r.addr, 1).await;
        n += 1;
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        assert!(is_on(&reply.worker(), &alive), "{}", reply.worker());
        let rows = workers(&r).await;
        // Engine-wide: both ranks of the dead engine count every refused connection.
        assert_eq!(rows[0]["consecutive_failures"], n.min(3));
        assert_eq!(rows[1]["consecutive_failures"], n.min(3));
        if rows[..2].iter().all(|w| w["reason_kind"] == "ejected") {
            break rows;
        }
        assert!(n < 10, "not ejected: {rows:#?}");
    };
    let to_eject = killed.elapsed();
    for w in &rows[..2] {
        assert!(
            reason(w).starts_with("ejected: 3 consecutive transport errors"),
            "{w}"
        );
    }
    assert_eq!(
        n, 3,
        "one refused connection per request, each against both ranks"
    );
    assert_eq!(
        r.metrics.retries_total(),
        3,
        "each refused request failed over once, to the other engine"
    );
    assert!(rows[2..].iter().all(|w| w["consecutive_failures"] == 0));
    println!("dead engine: both ranks ejected after {n} requests, {to_eject:?} after the kill");
}

/// 10b. An engine's 4xx is the client's business: passed through as the engine wrote it, never
/// retried, never counted against the rank.
#[tokio::test]
async fn engine_4xx_never_counts() {
    let picky = engine(sim(Flavor::Sglang, 2, 4)).await;
    let r = router(
        &format!("[routing]\neject_after = 1\n{FAST}"),
        &[engine_toml(&picky.url(), "sglang", 2, 4)],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    for (status, kind) in [(400, "BadRequestError"), (429, "RateLimitError")] {
        picky.set_fail(status, 100.0).unwrap();
        for _ in 0..4 {
            let reply = chat(r.addr, 1).await;
            assert_eq!(reply.status, status);
            let v = assert_openai_error(&reply.body, status, Some(kind));
            assert!(v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("simulated"));
        }
    }
    assert_eq!(picky.requests_received(), 8, "a 4xx is never retried");
    let rows = workers(&r).await;
    for w in &rows {
        assert_eq!(w["consecutive_failures"], 0, "{w}");
        assert_eq!(w["reason"], Value::Null, "{w}");
    }
    assert_eq!(r.metrics.retries_total(), 0);
    picky.set_fail(400, 0.0).unwrap();
    assert_eq!(chat(r.addr, 1).await.status, 200);
}
