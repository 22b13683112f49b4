//! A prefill server's answer is untrusted input: `kv_transfer_params` naming a host other than
//! the prefill server's own never reach a decode (the client gets a 502 that names no address,
//! the prefill rank is judged failing with `bad_params`); vLLM's default side-channel host
//! (`localhost`) for a prefill server on loopback passes.

use std::time::Duration;

use rankgate::app::Router;
use rankgate_sim::sim::{PdConfig, PdRole, SimConfig, SimEngine, SimFlavor};

use crate::common::*;
use crate::helpers::*;

/// A prefill server that names `side_host` as where its KV is, a decode server, and a router
/// with the default `expose_worker` over both.
async fn pair(side_host: &str) -> (SimEngine, SimEngine, Router) {
    let p = engine(SimConfig {
        pd: PdConfig {
            side_host: side_host.into(),
            ..PdConfig::default()
        },
        ..side(SimFlavor::Vllm, Some(PdRole::Prefill), 1)
    })
    .await;
    let d = engine(side(SimFlavor::Vllm, Some(PdRole::Decode), 1)).await;
    let tables = [
        role_toml(&p, "vllm", 1, "prefill"),
        role_toml(&d, "vllm", 1, "decode"),
    ];
    let r = router_with("expose_worker = \"none\"", FAST, &tables).await;
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows.len() == 2 && rows.iter().all(|w| w["telemetry"] == "available")
    })
    .await;
    wait_models(&r).await;
    (p, d, r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_naming_a_foreign_host_never_reaches_a_decode() {
    let (p, d, r) = pair("6.6.6.6").await;
    for _ in 0..3 {
        let reply = chat(r.addr, 4).await;
        let body = reply.assert_openai_error(502, None);
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("KV transfer parameters were refused")
                && message.contains("remote_host"),
            "{message}"
        );
        let text = String::from_utf8_lossy(&reply.body);
        assert!(
            !text.contains("6.6.6.6") && !text.contains("127.0.0.1"),
            "{text}"
        );
    }
    assert_eq!(p.requests_received(), 3, "each request was prefilled once");
    assert_eq!(d.requests_received(), 0, "no decode saw the parameters");
    let m = metrics_text(&r).await;
    assert!(
        m.contains("rankgate_pd_failures_total{leg=\"prefill\",kind=\"bad_params\"} 3"),
        "{m}"
    );
    assert!(m.contains("rankgate_pd_decoded_total 0"), "{m}");
    // Three in a row: the prefill rank is shown failing, with the likely cause.
    let rows = workers(&r).await;
    let prefill = rows.iter().find(|w| w["engine"] == p.url()).expect("row");
    assert_eq!(prefill["pd"]["state"], "failing", "{prefill}");
    assert_eq!(prefill["pd"]["kind"], "bad_params", "{prefill}");
    assert!(
        prefill["pd"]["likely_cause"]
            .as_str()
            .is_some_and(|c| c.contains("kv_hosts")),
        "{prefill}"
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_default_side_channel_host_passes_for_a_prefill_on_loopback() {
    let (p, d, r) = pair("localhost").await;
    let reply = chat(r.addr, 4).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!((p.requests_received(), d.requests_received()), (1, 1));
    r.shutdown().await;
}
