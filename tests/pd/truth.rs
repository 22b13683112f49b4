//! PD failures tell the truth, through the real binary with its access log on: a decode that
//! answers 500 is the client's answer as the decode's failure (never a second prefill's "no
//! rank"), failed over to another decode rank with the same blocks where there is one, one
//! prefill either way; the access line counts each leg's attempts; a client that leaves between
//! the legs or during the decode leg is logged (status 499, with the stage) and counted by stage.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use rankgate_sim::sim::{PdConfig, PdRole, SimConfig, SimEngine, SimFlavor};
use serde_json::{json, Value};

use crate::common::binary::Rankgate;
use crate::common::*;
use crate::helpers::*;

/// The real binary before `p` (prefill, one rank) and `d` (decode, `d_dp` ranks), access log
/// on, once every rank has telemetry and models.
async fn serve(name: &str, p: &SimEngine, d: &SimEngine, d_dp: u32) -> Rankgate {
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nshutdown_delay = \"0s\"\naccess_log = true\n{FAST}{}{}",
        role_toml(p, "vllm", 1, "prefill"),
        role_toml(d, "vllm", d_dp, "decode"),
    );
    let rg = Rankgate::start(name, &config, None).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let v: Value = serde_json::from_slice(&get(rg.admin_addr, "/workers").await.body)
            .unwrap_or(Value::Null);
        let rows = v.as_array().cloned().unwrap_or_default();
        if rows.len() == 1 + d_dp as usize
            && rows.iter().all(|w| {
                w["telemetry"] == "available"
                    && w["models"].as_array().is_some_and(|m| !m.is_empty())
            })
        {
            return rg;
        }
        assert!(tokio::time::Instant::now() < deadline, "never ready: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A chat with request id `id`; its status and body.
async fn chat_as(rg: &Rankgate, id: &str) -> (u16, Value) {
    let req = post(rg.addr, "/v1/chat/completions")
        .header("x-request-id", id)
        .body(Full::new(Bytes::from(chat_body(4, false))))
        .unwrap();
    let reply = send(req).await;
    let body = serde_json::from_slice(&reply.body).unwrap_or(Value::Null);
    (reply.status.as_u16(), body)
}

/// A completion with request id `id` the client gives up on after `patience`.
async fn given_up(rg: &Rankgate, id: &str, patience: Duration) {
    let body = json!({"model": "tiny-llama", "prompt": "word ".repeat(50), "max_tokens": 4});
    let req = post(rg.addr, "/v1/completions")
        .header("x-request-id", id)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let gone = tokio::time::timeout(patience, client().request(req)).await;
    assert!(gone.is_err(), "the request should outlast the client");
}

/// The access line of request `id` (bounded wait).
async fn access_line(rg: &mut Rankgate, id: &str) -> String {
    let line = rg
        .wait_log(&format!("request_id=\"{id}\""), Duration::from_secs(10))
        .await;
    assert!(line.contains("rankgate::access"), "{line}");
    line
}

/// Waits (bounded) until the router's `/metrics` has `line`.
async fn metric(rg: &Rankgate, line: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = String::from_utf8_lossy(&get(rg.admin_addr, "/metrics").await.body).to_string();
        if text.lines().any(|l| l == line) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {line} in\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn decode_failing_first(dp: u32) -> SimConfig {
    SimConfig {
        fail_status: 500,
        fail_first: Some(1),
        ..side(SimFlavor::Vllm, Some(PdRole::Decode), dp)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_decode_with_no_other_decode_rank_is_the_clients_answer_after_one_prefill() {
    let p = engine(side(SimFlavor::Vllm, Some(PdRole::Prefill), 1)).await;
    let d = engine(decode_failing_first(1)).await;
    let mut rg = serve("pd-truth-500", &p, &d, 1).await;
    let (status, body) = chat_as(&rg, "pd-d500").await;
    // The decode's failure, not "no rank is reachable".
    assert_eq!(status, 500, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("decode rank failed: 500"), "{body}");
    assert!(!message.contains("no routable rank"), "{body}");
    // One prefill: no second one for a decode that has no other rank to go to.
    assert_eq!(p.requests_received(), 1);
    assert_eq!(d.requests_received(), 1);
    let line = access_line(&mut rg, "pd-d500").await;
    for field in [
        "status=500",
        "attempts=2",
        "prefill_attempts=1",
        "decode_attempts=1",
    ] {
        assert!(line.contains(field), "{field}: {line}");
    }
    assert!(line.contains("prefill_worker="), "{line}");
    metric(
        &rg,
        "rankgate_pd_failures_total{leg=\"decode\",kind=\"status\"} 1",
    )
    .await;
    // The next request is served as usual.
    assert_eq!(chat_as(&rg, "pd-after").await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_decode_goes_to_another_decode_rank_with_the_same_blocks() {
    let p = engine(side(SimFlavor::Vllm, Some(PdRole::Prefill), 1)).await;
    let d = engine(decode_failing_first(2)).await;
    let mut rg = serve("pd-truth-failover", &p, &d, 2).await;
    let (status, body) = chat_as(&rg, "pd-over").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(p.requests_received(), 1, "one prefill");
    assert_eq!(d.requests_received(), 2);
    assert_eq!(d.pd_counts().iter().map(|c| c.transfers).sum::<u64>(), 1);
    let line = access_line(&mut rg, "pd-over").await;
    for field in [
        "status=200",
        "attempts=3",
        "prefill_attempts=1",
        "decode_attempts=2",
    ] {
        assert!(line.contains(field), "{field}: {line}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_between_the_legs_or_during_the_decode_is_logged_and_counted() {
    // The prefill's answer body comes 800 ms after its head, the blocks lent already; a lease
    // long enough that only a release frees them within the test.
    let lease = Duration::from_secs(60);
    let p = engine(SimConfig {
        pd: PdConfig {
            kv_lease: lease,
            answer_delay: Duration::from_millis(800),
            ..PdConfig::default()
        },
        ..side(SimFlavor::Vllm, Some(PdRole::Prefill), 1)
    })
    .await;
    let d = engine(side(SimFlavor::Vllm, Some(PdRole::Decode), 1)).await;
    let mut rg = serve("pd-truth-gone", &p, &d, 1).await;

    given_up(&rg, "pd-between", Duration::from_millis(300)).await;
    metric(&rg, "rankgate_pd_abandoned_total{stage=\"between\"} 1").await;
    let line = access_line(&mut rg, "pd-between").await;
    for field in [
        "status=499",
        "between",
        "prefill_attempts=1",
        "decode_attempts=0",
    ] {
        assert!(line.contains(field), "{field}: {line}");
    }
    // No vLLM API frees a finished prefill's blocks: a decode of one token reads them, long
    // before the lease would have run out.
    metric(&rg, "rankgate_pd_released_total{outcome=\"read\"} 1").await;
    until("the blocks are released", Duration::from_secs(10), || {
        p.pd_counts()[0].held_leases == 0
    })
    .await;
    assert_eq!(p.pd_counts()[0].expired, 0, "{:?}", p.pd_counts());
    assert_eq!(d.pd_counts()[0].transfers, 1, "{:?}", d.pd_counts());
    assert_eq!(d.seen().len(), 1, "the release decode only");

    // The decode never answers: the client leaves during the decode leg.
    d.set_hang_requests(true);
    given_up(&rg, "pd-decode", Duration::from_millis(1500)).await;
    metric(&rg, "rankgate_pd_abandoned_total{stage=\"decode\"} 1").await;
    let line = access_line(&mut rg, "pd-decode").await;
    for field in ["status=499", "decode_attempts=1", "prefill_attempts=1"] {
        assert!(line.contains(field), "{field}: {line}");
    }
    assert!(
        line.contains("abandoned=\"decode\"") || line.contains("abandoned=decode"),
        "{line}"
    );
    metric(&rg, "rankgate_pd_abandoned_total{stage=\"prefill\"} 0").await;
}
