//! Prefill/decode fleets that pass every health check and fail every request: `check` (or
//! `check --probe`) refuses each, naming the cause; served anyway by the real binary, the
//! failing side is logged at WARN once with the likely cause, counted by leg and kind (never as
//! decoded) and shown failing in `/workers`. And what the fleet survives: a decode rank whose
//! first request fails with 500 before any byte (another decode rank takes it), an SGLang
//! prefill rank failing before its first byte (another prefill rank takes it, with a new room).

use std::path::PathBuf;
use std::process::Output;
use std::time::Duration;

use rankgate::app::Router;
use rankgate_sim::sim::{PdConfig, PdRole, SimConfig, SimEngine, SimFlavor};
use serde_json::Value;

use crate::common::binary::Rankgate;
use crate::common::*;
use crate::helpers::*;

/// Runs `rankgate check [--probe] --config <engines>` off the runtime (the engines it probes
/// run on it).
async fn check(name: &str, engines: &str, probe: bool) -> Output {
    let path: PathBuf =
        std::env::temp_dir().join(format!("rankgate-pd-{}-{name}.toml", std::process::id()));
    std::fs::write(&path, engines).unwrap();
    let out = tokio::task::spawn_blocking(move || {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rankgate"));
        cmd.arg("check");
        if probe {
            cmd.arg("--probe");
        }
        let out = cmd.arg("--config").arg(&path).output().unwrap();
        let _ = std::fs::remove_file(&path);
        out
    })
    .await
    .unwrap();
    out
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The real binary serving `engines`.
async fn serve(name: &str, engines: &str) -> Rankgate {
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nshutdown_delay = \"0s\"\n{FAST}{engines}"
    );
    Rankgate::start(name, &config, None).await
}

/// `n` chat requests one after the other; their statuses.
async fn chats(rg: &Rankgate, n: usize) -> Vec<u16> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(chat(rg.addr, 4).await.status.as_u16());
    }
    out
}

async fn scrape(rg: &Rankgate) -> String {
    String::from_utf8_lossy(&get(rg.admin_addr, "/metrics").await.body).to_string()
}

/// Waits (bounded) until the router's `/metrics` has `line`.
async fn metric_line(rg: &Rankgate, line: &str) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = scrape(rg).await;
        if text.lines().any(|l| l == line) {
            return text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {line} in\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The `/workers` rows of `engine`.
async fn rows_of(rg: &Rankgate, engine: &SimEngine) -> Vec<Value> {
    let v: Value = serde_json::from_slice(&get(rg.admin_addr, "/workers").await.body).unwrap();
    (v.as_array().unwrap().iter())
        .filter(|w| w["engine"] == engine.url())
        .cloned()
        .collect()
}

/// Waits (bounded) until every rank of the engines has telemetry and its models.
async fn ready(rg: &Rankgate, engines: &[&SimEngine]) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut all = true;
        for e in engines {
            let rows = rows_of(rg, e).await;
            all &= !rows.is_empty()
                && rows.iter().all(|w| {
                    w["telemetry"] == "available"
                        && w["models"].as_array().is_some_and(|m| !m.is_empty())
                });
        }
        if all {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_and_decode_servers_of_different_flavors_are_refused_and_counted_when_served() {
    let p = engine(side(SimFlavor::Sglang, Some(PdRole::Prefill), 1)).await;
    let d = engine(side(SimFlavor::Vllm, Some(PdRole::Decode), 1)).await;
    let engines = role_toml(&p, "sglang", 1, "prefill") + &role_toml(&d, "vllm", 1, "decode");
    let o = check("flavors", &engines, false).await;
    assert_eq!(o.status.code(), Some(64), "{}", text(&o));
    assert!(text(&o).contains("no flavor in common"), "{}", text(&o));
    let mut rg = serve("pd-flavors", &engines).await;
    ready(&rg, &[&p, &d]).await;
    let statuses = chats(&rg, 3).await;
    assert_eq!(statuses, [503, 503, 503]);
    let m = metric_line(
        &rg,
        "rankgate_pd_failures_total{leg=\"prefill\",kind=\"unpaired\"} 3",
    )
    .await;
    assert!(m.contains("rankgate_pd_decoded_total 0"), "{m}");
    let warned = "disaggregated requests cannot be served";
    rg.wait_log(warned, Duration::from_secs(5)).await;
    assert_eq!(rg.count(warned), 1, "{:?}", rg.log());
    assert!(p.seen().is_empty() && d.seen().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_server_without_a_kv_connector_is_caught_by_the_probe_and_marked_when_served() {
    // A vLLM server given role "prefill" that runs no KV connector: its answers carry no
    // kv_transfer_params.
    let p = engine(side(SimFlavor::Vllm, None, 1)).await;
    let d = engine(side(SimFlavor::Vllm, Some(PdRole::Decode), 1)).await;
    let engines = role_toml(&p, "vllm", 1, "prefill") + &role_toml(&d, "vllm", 1, "decode");
    let o = check("no-connector", &engines, true).await;
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("returned no kv_transfer_params") && text(&o).contains(&p.url()),
        "{}",
        text(&o)
    );
    let mut rg = serve("pd-no-connector", &engines).await;
    ready(&rg, &[&p, &d]).await;
    assert_eq!(chats(&rg, 4).await, [502, 502, 502, 502]);
    let m = metric_line(
        &rg,
        "rankgate_pd_failures_total{leg=\"prefill\",kind=\"no_params\"} 4",
    )
    .await;
    assert!(m.contains("rankgate_pd_decoded_total 0"), "{m}");
    let warned = "a prefill side fails every disaggregated request";
    let line = rg.wait_log(warned, Duration::from_secs(5)).await;
    assert_eq!(rg.count(warned), 1, "{:?}", rg.log());
    assert!(
        line.contains("KV connector") && line.contains(&p.url()),
        "{line}"
    );
    let rows = rows_of(&rg, &p).await;
    assert_eq!(rows[0]["pd"]["state"], "failing", "{rows:?}");
    assert_eq!(rows[0]["pd"]["kind"], "no_params", "{rows:?}");
    assert!(d.seen().is_empty(), "no decode leg");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_bootstrap_port_that_does_not_answer_is_caught_and_counted_on_the_decode_leg() {
    let short = PdConfig {
        bootstrap_timeout: Duration::from_secs(1),
        waiting_timeout: Duration::from_secs(1),
        ..PdConfig::default()
    };
    let p = engine(SimConfig {
        pd: short.clone(),
        ..side(SimFlavor::Sglang, Some(PdRole::Prefill), 1)
    })
    .await;
    let d = engine(SimConfig {
        pd: short,
        ..side(SimFlavor::Sglang, Some(PdRole::Decode), 1)
    })
    .await;
    // A port nothing listens on.
    let wrong = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    assert_ne!(Some(wrong), p.bootstrap_port());
    let engines = format!(
        "[[engines]]\nurl = \"{}\"\nflavor = \"sglang\"\ndp_size = 1\nrole = \"prefill\"\nbootstrap_port = {wrong}\n{}",
        p.url(),
        role_toml(&d, "sglang", 1, "decode")
    );
    let o = check("bootstrap", &engines, true).await;
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("bootstrap_port {wrong} does not answer")),
        "{}",
        text(&o)
    );
    let mut rg = serve("pd-bootstrap", &engines).await;
    ready(&rg, &[&p, &d]).await;
    assert_eq!(chats(&rg, 3).await, [500, 500, 500]);
    let m = metric_line(
        &rg,
        "rankgate_pd_failures_total{leg=\"decode\",kind=\"status\"} 3",
    )
    .await;
    assert!(m.contains("rankgate_pd_decoded_total 0"), "{m}");
    let warned = "a decode side fails every disaggregated request";
    let line = rg.wait_log(warned, Duration::from_secs(5)).await;
    assert_eq!(rg.count(warned), 1, "{:?}", rg.log());
    assert!(line.contains("bootstrap_port"), "{line}");
    assert_eq!(rows_of(&rg, &d).await[0]["pd"]["state"], "failing");
}

#[tokio::test]
async fn a_decode_rank_failing_its_first_request_before_any_byte_is_failed_over() {
    let p = engine(side(SimFlavor::Vllm, Some(PdRole::Prefill), 1)).await;
    // Two decode ranks; whichever takes the first request answers it 500 before any byte (its
    // KV pull failed, as vLLM's first NIXL handshake can).
    let d = engine(SimConfig {
        fail_status: 500,
        fail_first: Some(1),
        ..side(SimFlavor::Vllm, Some(PdRole::Decode), 2)
    })
    .await;
    let tables = [
        role_toml(&p, "vllm", 1, "prefill"),
        role_toml(&d, "vllm", 2, "decode"),
    ];
    let r = one_chat_answered(&tables).await;
    // The decode server was asked twice (the failed attempt is not among the requests it
    // served), the second time on the other rank; one prefill.
    assert_eq!(d.requests_received(), 2);
    assert_eq!(d.seen().len(), 1, "{:?}", d.seen());
    assert_eq!(p.requests_received(), 1);
    let m = metrics_text(&r).await;
    assert!(m.contains("rankgate_pd_decoded_total 1"), "{m}");
    assert!(
        m.contains("rankgate_pd_failures_total{leg=\"decode\",kind=\"status\"} 0"),
        "{m}"
    );
    assert!(m.contains("rankgate_retries_total 1"), "{m}");
    r.shutdown().await;
}

#[tokio::test]
async fn an_sglang_prefill_rank_failing_before_its_first_byte_is_failed_over() {
    // Whichever prefill rank takes the first request answers 503 at once.
    let p = engine(SimConfig {
        fail_status: 503,
        fail_first: Some(1),
        ..side(SimFlavor::Sglang, Some(PdRole::Prefill), 2)
    })
    .await;
    let d = engine(side(SimFlavor::Sglang, Some(PdRole::Decode), 1)).await;
    let tables = [
        role_toml(&p, "sglang", 2, "prefill"),
        role_toml(&d, "sglang", 1, "decode"),
    ];
    let r = one_chat_answered(&tables).await;
    assert_eq!(p.requests_received(), 2);
    // One prefill leg served, on the rank that did not fail; the first decode leg (waiting
    // on the failed rank's room) was cancelled with it, before or after reaching its engine.
    assert_eq!(p.seen().len(), 1, "{:?}", p.seen());
    assert!((1..=2).contains(&d.seen().len()), "{:?}", d.seen());
    let m = metrics_text(&r).await;
    assert!(m.contains("rankgate_pd_decoded_total 1"), "{m}");
    assert!(m.contains("rankgate_retries_total 1"), "{m}");
    r.shutdown().await;
}

/// A router before the three ranks of `tables`, once all have numbers and models, that has
/// answered one chat with 200 (the failed attempt before it, if any, failed over).
async fn one_chat_answered(tables: &[String]) -> Router {
    let r = router(FAST, tables).await;
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows.len() == 3 && rows.iter().all(|w| w["telemetry"] == "available")
    })
    .await;
    wait_models(&r).await;
    let reply = chat(r.addr, 4).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    r
}
