//! The simulated vLLM's prefill/decode edges: an expired lease frees the blocks and the late decode
//! fails as vLLM does, malformed params are a 400 naming the field, requests without a leg are
//! ordinary (a streamed prefill still lends), and fault knobs work on role servers.

use std::time::Duration;

use rankgate_sim::sim::PdConfig;
use serde_json::{json, Value};

use crate::common;
use crate::common::until;
use crate::helpers::*;

#[tokio::test]
async fn vllm_an_expired_lease_frees_the_blocks_and_the_late_decode_fails_as_vllm_does() {
    let short = PdConfig {
        kv_lease: Duration::from_millis(100),
        ..PdConfig::default()
    };
    let (p, d) = vllm_pair(1, short).await;
    let p_fix = fixture(P_CHAT);
    let r = replay(p.addr, &p_fix, &p_fix["request"]["body"]).await;
    assert_eq!(r.status, 200);
    let params = r.json()["kv_transfer_params"].clone();
    until("the lease runs out", Duration::from_secs(10), || {
        p.pd_counts()[0].expired == 1
    })
    .await;
    assert_eq!(p.pd_counts()[0].held_leases, 0);
    assert_eq!(p.kv_usage(), [0.0], "expired blocks are free");

    let d_fix = fixture(D_CHAT);
    let r = replay(d.addr, &d_fix, &decode_body(&d_fix, &params)).await;
    // kv_load_failure_policy "fail": the request errors, as the recorded failed decode did.
    assert_eq!(r.status, 500);
    let recorded = fixture(D_FAILED);
    assert_eq!(r.json(), recorded["response"]["body"]);
    let c = d.pd_counts()[0];
    assert_eq!(
        (c.failed_transfers, c.expired, c.external_kv_transfer),
        (1, 1, 0)
    );
    assert_eq!(p.pd_counts()[0].notifications_after_expiry, 1);
    let pm = scrape(&p).await;
    assert_eq!(
        metric(&pm, &format!("vllm:nixl_num_kv_expired_reqs_total{E0}")),
        1.0
    );
    assert_eq!(d.kv_usage(), [0.0], "the failed request holds nothing");
}

#[tokio::test]
async fn vllm_malformed_params_are_a_400_naming_the_field() {
    let (p, d) = vllm_pair(1, PdConfig::default()).await;
    let good = json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_block_ids": [[1, 2]], "remote_engine_id": "x", "remote_request_id": "r",
        "remote_host": "127.0.0.1", "remote_port": 1, "remote_num_tokens": 3});
    let cases = [
        (&d, json!("not an object"), "kv_transfer_params"),
        (
            &d,
            {
                let mut v = good.clone();
                v["remote_port"] = json!("33110");
                v
            },
            "kv_transfer_params.remote_port",
        ),
        (
            &d,
            {
                let mut v = good.clone();
                v.as_object_mut().unwrap().remove("remote_host");
                v
            },
            "kv_transfer_params.remote_host",
        ),
        (
            &d,
            {
                let mut v = good.clone();
                v["remote_block_ids"] = json!([["a"]]);
                v
            },
            "kv_transfer_params.remote_block_ids",
        ),
        (
            &p,
            json!({"do_remote_decode": "yes"}),
            "kv_transfer_params.do_remote_decode",
        ),
    ];
    for (e, params, field) in cases {
        let body = json!({"model": "tiny-llama", "prompt": "hello", "max_tokens": 2,
            "kv_transfer_params": params});
        let r = common::post_json(e.addr, "/v1/completions", body).await;
        let v = r.assert_openai_error(400, Some("BadRequestError"));
        assert_eq!(v["error"]["param"], field, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(field),
            "{v}"
        );
    }
    assert_eq!(
        d.pd_counts()[0].transfers + d.pd_counts()[0].failed_transfers,
        0
    );
}

#[tokio::test]
async fn vllm_requests_without_a_leg_are_ordinary_and_a_streamed_prefill_still_lends() {
    let (p, d) = vllm_pair(1, PdConfig::default()).await;
    // D without params prefills locally, as a real D does.
    let body = json!({"model": "tiny-llama", "prompt": "a prompt of some tokens", "max_tokens": 2});
    let r = common::post_json(d.addr, "/v1/completions", body.clone()).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["kv_transfer_params"], Value::Null);
    let c = d.pd_counts()[0];
    assert_eq!((c.local_compute, c.external_kv_transfer), (5, 0));
    // P asked to lend but to stream: it answers the stream (no params in it) and still holds.
    let mut streamed = body;
    streamed["stream"] = json!(true);
    streamed["kv_transfer_params"] = json!({"do_remote_decode": true});
    let r = common::post_json(p.addr, "/v1/completions", streamed).await;
    assert_eq!(r.status, 200);
    let text = String::from_utf8(r.body.to_vec()).unwrap();
    assert!(
        text.contains("data: [DONE]") && !text.contains("kv_transfer_params"),
        "{text}"
    );
    assert_eq!(p.pd_counts()[0].held_leases, 1);
}

#[tokio::test]
async fn vllm_fault_knobs_work_on_role_servers_and_a_dead_prefill_fails_the_decode() {
    let (p, d) = vllm_pair(1, PdConfig::default()).await;
    let p_fix = fixture(P_CHAT);
    p.set_fail(503, 100.0).unwrap();
    let r = replay(p.addr, &p_fix, &p_fix["request"]["body"]).await;
    r.assert_openai_error(503, None);
    p.set_fail(503, 0.0).unwrap();
    let r = replay(p.addr, &p_fix, &p_fix["request"]["body"]).await;
    let params = r.json()["kv_transfer_params"].clone();
    p.kill().await;
    let d_fix = fixture(D_CHAT);
    let mut body = decode_body(&d_fix, &params);
    body["stream"] = json!(true);
    let r = replay(d.addr, &d_fix, &body).await;
    // A stream has its headers out already: the failure is an error event, then [DONE].
    assert_eq!(r.status, 200);
    let text = String::from_utf8(r.body.to_vec()).unwrap();
    assert!(
        text.contains("\"Internal server error\"") && text.contains("data: [DONE]"),
        "{text}"
    );
    assert_eq!(d.pd_counts()[0].failed_transfers, 1);
}
