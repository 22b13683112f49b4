//! What a disaggregated request must never do, and what rankgate says about it: a client gone
//! during prefill starts no decode and holds no blocks, blocks no decode pulls are not held past
//! the lease, a prefill answer without params is an error (never a silent recompute), a model with
//! no decode server says so, the pick explanation shows both legs, and the gRPC front door names
//! why it serves no disaggregated model.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use rankgate::app::Router;
use rankgate_sim::sim::{PdConfig, PdRole, SimConfig, SimEngine, SimFlavor};
use serde_json::{json, Value};

use crate::common;
use crate::common::admin::{token_env, TOKEN};
use crate::common::*;
use crate::helpers::*;

/// A prefill and a decode server behind a router; the prefill's lease is `lease` and it
/// prefills at `prefill_rate` tokens a second.
async fn pair(lease: Duration, prefill_rate: f64) -> (SimEngine, SimEngine, Router) {
    let p = engine(SimConfig {
        pd: PdConfig {
            kv_lease: lease,
            ..PdConfig::default()
        },
        prefill_tokens_per_sec: prefill_rate,
        ..side(SimFlavor::Vllm, Some(PdRole::Prefill), 1)
    })
    .await;
    let d = engine(side(SimFlavor::Vllm, Some(PdRole::Decode), 1)).await;
    let tables = [
        role_toml(&p, "vllm", 1, "prefill"),
        role_toml(&d, "vllm", 1, "decode"),
    ];
    let r = router(FAST, &tables).await;
    wait_models(&r).await;
    (p, d, r)
}

/// A completion the client gives up on after `patience`.
async fn given_up(r: &Router, patience: Duration) {
    let body = json!({"model": "tiny-llama", "prompt": "word ".repeat(200), "max_tokens": 4});
    let req = post(r.addr, "/v1/completions")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let gone = tokio::time::timeout(patience, client().request(req)).await;
    assert!(gone.is_err(), "the request should outlast the client");
}

#[tokio::test]
async fn a_client_gone_during_prefill_starts_no_decode_and_leaves_no_blocks_held() {
    // A slow prefill: the client is gone before it ends.
    let (p, d, r) = pair(Duration::from_secs(30), 200.0).await;
    given_up(&r, Duration::from_millis(300)).await;
    until(
        "the abandoned request is counted",
        Duration::from_secs(10),
        || p.seen().len() == 1,
    )
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !metrics_text(&r)
        .await
        .contains("rankgate_pd_abandoned_total{stage=\"prefill\"} 1")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{}",
            metrics_text(&r).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The prefill server dropped the request its client (rankgate) left: nothing is lent,
    // nothing held, and no decode was started.
    until("nothing held", Duration::from_secs(10), || {
        p.pd_counts()[0].held_leases == 0
    })
    .await;
    assert!(d.seen().is_empty(), "no decode leg");
    r.shutdown().await;
}

#[tokio::test]
async fn blocks_no_decode_pulls_are_not_held_past_the_lease() {
    let lease = Duration::from_millis(400);
    let (p, d, r) = pair(lease, 1e6).await;
    // The decode never answers: the client gives up with the blocks lent and unpulled.
    d.set_hang_requests(true);
    given_up(&r, Duration::from_millis(300)).await;
    assert_eq!(d.pd_counts()[0].transfers, 0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while p.pd_counts()[0].held_leases > 0 || p.pd_counts()[0].expired == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lease never ran out: {:?}",
            p.pd_counts()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(p.pd_counts()[0].expired, 1, "{:?}", p.pd_counts());
    r.shutdown().await;
}

#[tokio::test]
async fn a_prefill_answer_without_params_is_an_error_never_a_silent_recompute() {
    // A server declared a prefill server that is not one: its answers carry no parameters.
    let p = engine(side(SimFlavor::Vllm, None, 1)).await;
    let d = engine(side(SimFlavor::Vllm, Some(PdRole::Decode), 1)).await;
    let tables = [
        role_toml(&p, "vllm", 1, "prefill"),
        role_toml(&d, "vllm", 1, "decode"),
    ];
    let r = router(FAST, &tables).await;
    wait_models(&r).await;
    let reply = chat(r.addr, 4).await;
    let v = reply.assert_openai_error(502, None);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("kv_transfer_params"),
        "{v}"
    );
    assert!(d.seen().is_empty(), "no decode leg");
    let metrics = get(r.admin_addr, "/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body).to_string();
    assert!(
        text.contains("rankgate_pd_failures_total{leg=\"prefill\",kind=\"no_params\"} 1"),
        "{text}"
    );
    r.shutdown().await;
}

#[tokio::test]
async fn a_model_with_prefill_servers_and_no_decode_server_says_so() {
    let p = engine(side(SimFlavor::Vllm, Some(PdRole::Prefill), 1)).await;
    let r = router(FAST, &[role_toml(&p, "vllm", 1, "prefill")]).await;
    wait_models(&r).await;
    let v = chat(r.addr, 4).await.assert_openai_error(503, None);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no decode server"),
        "{v}"
    );
    r.shutdown().await;
}

#[tokio::test]
async fn the_pick_explanation_shows_both_legs() {
    let (p, d, r) = pd_fleet(SimFlavor::Vllm, 1, 1, 2, &token_env()).await;
    let req = post(r.addr, "/v1/chat/completions")
        .header("x-rankgate-debug", "1")
        .header("x-rankgate-admin-token", TOKEN)
        .body(Full::new(Bytes::from(chat_body(4, false))))
        .unwrap();
    let reply = send(req).await;
    assert_eq!(reply.status, 200);
    let picks: Vec<Value> = (reply.headers.get_all("x-rankgate-pick").iter())
        .map(|v| serde_json::from_slice(v.as_bytes()).expect("x-rankgate-pick is JSON"))
        .collect();
    let legs: Vec<&str> = picks
        .iter()
        .map(|x| x["leg"].as_str().unwrap_or("-"))
        .collect();
    assert_eq!(legs, ["prefill", "decode"], "{picks:?}");
    for (x, e) in picks.iter().zip([&p[0], &d[0]]) {
        // Each leg's candidates are its own side's ranks only.
        let candidates = x["candidates"].as_array().unwrap();
        assert_eq!(candidates.len(), 2, "{x}");
        assert!(candidates
            .iter()
            .all(|c| c["worker"].as_str().unwrap().starts_with(&e.url())));
    }
    r.shutdown().await;
}

#[tokio::test]
async fn the_grpc_front_door_names_why_it_serves_no_disaggregated_model() {
    use common::grpc::{front, GRPC_FAST};
    use rankgate_sim::sim::SimFlavor as Flavor;
    let p = engine(side(SimFlavor::Vllm, Some(PdRole::Prefill), 1)).await;
    let d = engine(side(SimFlavor::Vllm, Some(PdRole::Decode), 1)).await;
    let (pg, dg) = (
        p.start_grpc(loopback()).await.expect("gRPC"),
        d.start_grpc(loopback()).await.expect("gRPC"),
    );
    let tables = [
        format!(
            "{}grpc_url = \"http://{pg}\"\n",
            role_toml(&p, "vllm", 1, "prefill")
        ),
        format!(
            "{}grpc_url = \"http://{dg}\"\n",
            role_toml(&d, "vllm", 1, "decode")
        ),
    ];
    let r = router(GRPC_FAST, &tables).await;
    wait_models(&r).await;
    let status = match front(&r, Flavor::Vllm).generate("pd-1", None, 4).await {
        Err(s) => s,
        Ok(_) => panic!("a disaggregated fleet's gRPC generate was served"),
    };
    assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");
    assert!(status.message().contains("prefill or decode"), "{status:?}");
    assert!(p.grpc_seen().is_empty() && d.grpc_seen().is_empty());
    r.shutdown().await;
}
