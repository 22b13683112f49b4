//! `/ready` during a fleet-wide engine outage, over real sockets: by default it turns 503 (a
//! Service then drops every rankgate pod and clients get connection refused);
//! `server.ready_requires_routable = false` keeps it 200, so clients reach rankgate and get its
//! own 503 with `Retry-After`.
#![cfg(feature = "sim")] // the simulated engine

mod common;

use std::time::Duration;

use common::*;
use rankgate::app::Router;
use rankgate_sim::sim::SimEngine;
use rankgate_sim::sim::SimFlavor as Flavor;

/// Two simulated engines (ranks 0-1 and 2-3 of one DP group) behind a router with `server` keys, every rank polled
/// available before it returns.
async fn two_engines(server: &str) -> (SimEngine, SimEngine, Router) {
    let a = engine(sim(Flavor::Vllm, 2, 0)).await;
    let b = engine(sim(Flavor::Vllm, 2, 2)).await;
    let r = router_with(
        server,
        &format!("[routing]\nretry_after_secs = 7\n{FAST}"),
        &[
            engine_toml(&a.url(), "vllm", 2, 0),
            engine_toml(&b.url(), "vllm", 2, 2),
        ],
    )
    .await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    (a, b, r)
}

/// Kills both engines and waits until the router sees every rank unreachable.
async fn outage(a: &SimEngine, b: &SimEngine, r: &Router) {
    a.kill().await;
    b.kill().await;
    wait_workers(r, Duration::from_secs(10), |rows| {
        rows.len() == 4 && rows.iter().all(|w| w["reachable"] == false)
    })
    .await;
}

fn text(reply: &Reply) -> String {
    String::from_utf8_lossy(&reply.body).into_owned()
}

#[tokio::test]
async fn by_default_ready_is_503_when_every_engine_is_down() {
    let (a, b, r) = two_engines("").await;
    assert_eq!(get(r.admin_addr, "/ready").await.status, 200);
    outage(&a, &b, &r).await;
    let ready = get(r.admin_addr, "/ready").await;
    assert_eq!(ready.status, 503, "{}", text(&ready));
    assert!(
        text(&ready).contains("no routable rank"),
        "{}",
        text(&ready)
    );
}

#[tokio::test]
async fn ready_stays_200_and_clients_get_rankgates_503_when_asked() {
    let (a, b, r) = two_engines("ready_requires_routable = false\n").await;
    let ready = get(r.admin_addr, "/ready").await;
    assert_eq!(
        (ready.status.as_u16(), text(&ready).as_str()),
        (200, "ready\n")
    );
    outage(&a, &b, &r).await;

    let ready = get(r.admin_addr, "/ready").await;
    assert_eq!(ready.status, 200, "{}", text(&ready));
    assert!(
        text(&ready).contains("no rank is routable"),
        "{}",
        text(&ready)
    );
    // What a client behind the Service now gets: rankgate's answer, not a refused connection.
    let reply = chat(r.addr, 1).await;
    reply.assert_openai_error(503, None);
    assert_eq!(reply.headers["retry-after"], "7");
    // /health is unaffected either way.
    assert_eq!(get(r.admin_addr, "/health").await.status, 200);
}

#[tokio::test]
async fn a_drain_turns_ready_503_whatever_the_setting() {
    let (_a, _b, r) = two_engines("ready_requires_routable = false\n").await;
    assert_eq!(get(r.admin_addr, "/ready").await.status, 200);
    r.begin_drain();
    let ready = get(r.admin_addr, "/ready").await;
    assert_eq!(ready.status, 503, "{}", text(&ready));
    assert!(text(&ready).contains("draining"), "{}", text(&ready));
}
