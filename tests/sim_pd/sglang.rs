//! The simulated SGLang's prefill/decode: P and D at once with the room picking P's rank, a pinned
//! prefill rank overriding the room, D without its P timing out and bad fields 400s, and a
//! prefilled room nobody takes failing P after its bootstrap timeout.

use std::time::Duration;

use rankgate_sim::sim::{PdConfig, PdRole, SimEngine, SimFlavor};
use serde_json::{json, Value};

use crate::common;
use crate::common::engine;
use crate::helpers::*;

/// A chat request with SGLang's bootstrap fields.
fn sglang_body(p: &SimEngine, room: u64, max_tokens: u64) -> Value {
    json!({"model": "tiny-llama", "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "tell me about disaggregated serving"}],
        "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port().unwrap(),
        "bootstrap_room": room})
}

#[tokio::test]
async fn sglang_p_and_d_at_once_the_room_picks_p_rank() {
    let p = engine(role(
        SimFlavor::Sglang,
        PdRole::Prefill,
        2,
        PdConfig::default(),
    ))
    .await;
    let d = engine(role(
        SimFlavor::Sglang,
        PdRole::Decode,
        1,
        PdConfig::default(),
    ))
    .await;
    // The largest room there is lands on rank 1, the next on rank 0.
    for (n, room) in [(1u64 << 63) - 1, (1u64 << 63) - 2].into_iter().enumerate() {
        let body = sglang_body(&p, room, 6);
        let (pr, dr) = tokio::join!(
            common::post_json(p.addr, "/v1/chat/completions", body.clone()),
            common::post_json(d.addr, "/v1/chat/completions", body),
        );
        assert_eq!(pr.status, 200, "{}", String::from_utf8_lossy(&pr.body));
        assert_eq!(dr.status, 200, "{}", String::from_utf8_lossy(&dr.body));
        let rank = room % 2;
        assert_eq!(pr.headers["x-sim-rank"], rank.to_string().as_str());
        assert_eq!(p.seen().last().unwrap().rank as u64, rank);
        assert_eq!(
            pr.json()["usage"]["completion_tokens"],
            1,
            "P answers its one token"
        );
        let out = dr.json();
        assert_eq!(out["usage"]["completion_tokens"], 6);
        let prompt = out["usage"]["prompt_tokens"].as_u64().unwrap();
        let c = d.pd_counts()[0];
        assert_eq!(c.external_kv_transfer, prompt * (n as u64 + 1));
        assert_eq!(c.local_compute, 0);
    }
    assert_eq!(p.served(), [1, 1]);
    assert_eq!(p.kv_usage(), [0.0, 0.0], "handed over: nothing held");
}

#[tokio::test]
async fn sglang_a_pinned_prefill_rank_overrides_the_room_and_d_follows_when_told() {
    let p = engine(role(
        SimFlavor::Sglang,
        PdRole::Prefill,
        2,
        PdConfig::default(),
    ))
    .await;
    let d = engine(role(
        SimFlavor::Sglang,
        PdRole::Decode,
        1,
        PdConfig::default(),
    ))
    .await;
    let mut pb = sglang_body(&p, 7, 3);
    pb["data_parallel_rank"] = json!(0);
    let mut db = sglang_body(&p, 7, 3);
    db["disagg_prefill_dp_rank"] = json!(0);
    let (pr, dr) = tokio::join!(
        common::post_json(p.addr, "/generate", pb),
        common::post_json(d.addr, "/generate", db),
    );
    assert_eq!((pr.status.as_u16(), dr.status.as_u16()), (200, 200));
    assert_eq!(
        pr.headers["x-sim-rank"], "0",
        "pinned, though room 7 says 1"
    );
    assert_eq!(d.pd_counts()[0].transfers, 1);
}

#[tokio::test]
async fn sglang_d_without_its_p_times_out_and_bad_fields_are_400s() {
    let quick = PdConfig {
        waiting_timeout: Duration::from_millis(200),
        ..PdConfig::default()
    };
    let p = engine(role(
        SimFlavor::Sglang,
        PdRole::Prefill,
        2,
        PdConfig::default(),
    ))
    .await;
    let d = engine(role(SimFlavor::Sglang, PdRole::Decode, 1, quick)).await;
    // No P ever gets room 42.
    let r = common::post_json(d.addr, "/v1/chat/completions", sglang_body(&p, 42, 4)).await;
    let v = r.assert_openai_error(500, Some("InternalServerError"));
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("42") && msg.contains("timed out"), "{msg}");
    assert_eq!(d.pd_counts()[0].failed_transfers, 1);
    assert_eq!(d.kv_usage(), [0.0], "the failed request holds nothing");

    let mut no_room = sglang_body(&p, 1, 4);
    no_room.as_object_mut().unwrap().remove("bootstrap_room");
    let mut no_host = sglang_body(&p, 1, 4);
    no_host.as_object_mut().unwrap().remove("bootstrap_host");
    let mut big_room = sglang_body(&p, 1, 4);
    big_room["bootstrap_room"] = json!(1u64 << 63);
    let mut text_room = sglang_body(&p, 1, 4);
    text_room["bootstrap_room"] = json!("12");
    let mut bad_port = sglang_body(&p, 1, 4);
    bad_port["bootstrap_port"] = json!(70000);
    for (e, body, field) in [
        (&p, no_room, "bootstrap_room"),
        (&d, no_host, "bootstrap_host"),
        (&p, big_room, "bootstrap_room"),
        (&d, text_room, "bootstrap_room"),
        (&d, bad_port, "bootstrap_port"),
    ] {
        let r = common::post_json(e.addr, "/v1/chat/completions", body).await;
        let v = r.assert_openai_error(400, Some("BadRequestError"));
        assert_eq!(v["error"]["param"], field, "{v}");
    }
    assert_eq!(p.served(), [0, 0]);
}

#[tokio::test]
async fn sglang_a_prefilled_room_nobody_takes_fails_p_after_its_bootstrap_timeout() {
    let quick = PdConfig {
        bootstrap_timeout: Duration::from_millis(100),
        ..PdConfig::default()
    };
    let p = engine(role(SimFlavor::Sglang, PdRole::Prefill, 1, quick)).await;
    let r = common::post_json(p.addr, "/v1/chat/completions", sglang_body(&p, 5, 4)).await;
    r.assert_openai_error(500, Some("InternalServerError"));
    assert_eq!(p.kv_usage(), [0.0]);
    // It prefilled, then waited for a D in vain; its KV is free again.
    let messages = sglang_body(&p, 5, 4)["messages"].to_string();
    assert_eq!(p.pd_counts()[0].local_compute, (messages.len() / 4) as u64);
    assert_eq!(p.pd_counts()[0].failed_transfers, 1);
}
