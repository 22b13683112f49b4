//! The simulated engine as the prefill (P) and decode (D) sides of a disaggregated pair, over
//! real sockets, with this test acting as the router. vLLM: P answers the fixture's P leg with
//! `kv_transfer_params` shaped like the real vLLM 0.32's, holds the blocks until D pulls them or
//! the lease runs out, and D fails as vLLM's default `kv_load_failure_policy = "fail"` does.
//! SGLang: P and D get the same request with bootstrap fields, P's rank follows the room.
#![cfg(feature = "sim")] // the simulated engine

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{engine, get, post, send, until, Reply};
use http_body_util::Full;
use rankgate_sim::sim::{PdConfig, PdRole, SimConfig, SimEngine, SimFlavor};
use serde_json::{json, Value};

const P_CHAT: &str =
    include_str!("fixtures/vllm-0.32-pd/dp1/chat-nostream/1_prefill_exchange.json");
const D_CHAT: &str = include_str!("fixtures/vllm-0.32-pd/dp1/chat-nostream/2_decode_exchange.json");
const METRICS_CHAT: &str = include_str!("fixtures/vllm-0.32-pd/dp1/chat-nostream/3_metrics.json");
const P_COMPL: &str =
    include_str!("fixtures/vllm-0.32-pd/dp1/completions-stream/1_prefill_exchange.json");
const D_COMPL: &str =
    include_str!("fixtures/vllm-0.32-pd/dp1/completions-stream/2_decode_exchange.json");
const P_RANK1: &str =
    include_str!("fixtures/vllm-0.32-pd/dpP2/prank1-chat-nostream/1_prefill_exchange.json");
const D_FAILED: &str =
    include_str!("fixtures/vllm-0.32-pd/dpP2/prank1-chat-nostream/2_decode_exchange.json");

fn fixture(text: &str) -> Value {
    serde_json::from_str(text).expect("fixture JSON")
}

fn role(flavor: SimFlavor, role: PdRole, dp_size: u32, pd: PdConfig) -> SimConfig {
    SimConfig {
        flavor,
        dp_size,
        role: Some(role),
        pd,
        // Fast enough that the tests wait on little.
        decode_tokens_per_sec: 2000.0,
        ..SimConfig::default()
    }
}

async fn vllm_pair(p_dp: u32, pd: PdConfig) -> (SimEngine, SimEngine) {
    let p = engine(role(SimFlavor::Vllm, PdRole::Prefill, p_dp, pd)).await;
    let d = engine(role(
        SimFlavor::Vllm,
        PdRole::Decode,
        1,
        PdConfig::default(),
    ))
    .await;
    (p, d)
}

/// Replays a fixture's request (path, headers, body as given) to `addr`.
async fn replay(addr: std::net::SocketAddr, exchange: &Value, body: &Value) -> Reply {
    let url = exchange["request"]["url"].as_str().unwrap();
    let path = &url[url.find("/v1/").unwrap()..];
    let mut req = post(addr, path);
    for (k, v) in exchange["request"]["headers"].as_object().unwrap() {
        if !k.eq_ignore_ascii_case("content-type") {
            req = req.header(k.as_str(), v.as_str().unwrap());
        }
    }
    send(req.body(Full::new(Bytes::from(body.to_string()))).unwrap()).await
}

/// The fixture's D request with P's params in place of the recorded ones.
fn decode_body(exchange: &Value, params: &Value) -> Value {
    let mut body = exchange["request"]["body"].clone();
    body["kv_transfer_params"] = params.clone();
    body
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_u64() => "unsigned",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(a) if a.iter().all(Value::is_array) => "list of lists",
        Value::Array(_) => "list",
        Value::Object(_) => "object",
    }
}

/// A metric's value from a scrape: the line starting with `series ` (name and labels exactly).
fn metric(text: &str, series: &str) -> f64 {
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        .parse()
        .unwrap()
}

async fn scrape(e: &SimEngine) -> String {
    String::from_utf8(get(e.addr, "/metrics").await.body.to_vec()).unwrap()
}

fn by_source(source: &str) -> String {
    format!(
        "vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"tiny-llama\",source=\"{source}\"}}"
    )
}

const E0: &str = "{engine=\"0\",model_name=\"tiny-llama\"}";

#[tokio::test]
async fn vllm_p_then_d_moves_the_prompt_kv_and_releases_it() {
    let (p, d) = vllm_pair(1, PdConfig::default()).await;
    let p_fix = fixture(P_CHAT);
    let r = replay(p.addr, &p_fix, &p_fix["request"]["body"]).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let answer = r.json();
    let recorded = &p_fix["response"]["body"];
    assert_eq!(
        answer["id"], recorded["id"],
        "named by X-Request-Id as vLLM does"
    );
    assert_eq!(answer["usage"]["completion_tokens"], 1);
    let params = &answer["kv_transfer_params"];
    let want = recorded["kv_transfer_params"].as_object().unwrap();
    for (k, v) in want {
        assert_eq!(kind(&params[k]), kind(v), "{k}: {params}");
    }
    assert_eq!(params.as_object().unwrap().len(), want.len(), "{params}");
    for k in [
        "do_remote_prefill",
        "do_remote_decode",
        "remote_host",
        "transfer_mode",
        "tp_size",
    ] {
        assert_eq!(params[k], want[k], "{k}");
    }
    assert_eq!(
        params["remote_engine_id"],
        p.engine_id().as_str(),
        "DP=1: no _dp suffix"
    );
    assert_eq!(params["remote_port"], p.side_ports()[0]);
    assert_eq!(
        params["remote_num_tokens"],
        answer["usage"]["prompt_tokens"]
    );
    let rid = params["remote_request_id"].as_str().unwrap();
    let prefix = format!("{}-", recorded["id"].as_str().unwrap());
    assert!(
        rid.starts_with(&prefix) && rid.len() == prefix.len() + 8,
        "{rid}"
    );
    // The blocks stay held on P, where a router sees them.
    let held = p.pd_counts()[0];
    assert_eq!((held.held_leases, held.expired), (1, 0));
    assert!(p.kv_usage()[0] > 0.0);

    let d_fix = fixture(D_CHAT);
    let r = replay(d.addr, &d_fix, &decode_body(&d_fix, params)).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let out = r.json();
    assert_eq!(out["id"], d_fix["response"]["body"]["id"]);
    assert_eq!(
        out["kv_transfer_params"],
        Value::Null,
        "as the recorded D answer"
    );
    assert_eq!(out["usage"]["completion_tokens"], 8);
    assert_eq!(out["usage"]["prompt_tokens"], params["remote_num_tokens"]);

    // Pulled: P let the blocks go, D counts the prompt as transferred, not computed.
    let prompt = params["remote_num_tokens"].as_f64().unwrap();
    assert_eq!(p.pd_counts()[0].held_leases, 0);
    assert_eq!(p.kv_usage(), [0.0]);
    let dm = scrape(&d).await;
    assert_eq!(metric(&dm, &by_source("external_kv_transfer")), prompt);
    assert_eq!(metric(&dm, &by_source("local_compute")), 0.0);
    assert_eq!(
        metric(&dm, &format!("vllm:nixl_bytes_transferred_count{E0}")),
        1.0
    );
    assert!(metric(&dm, &format!("vllm:nixl_bytes_transferred_sum{E0}")) > 0.0);
    assert_eq!(
        metric(&dm, &format!("vllm:nixl_num_failed_transfers_total{E0}")),
        0.0
    );
    let pm = scrape(&p).await;
    assert_eq!(metric(&pm, &by_source("local_compute")), prompt);
    assert_eq!(
        metric(&pm, &format!("vllm:nixl_num_kv_expired_reqs_total{E0}")),
        0.0
    );
    // Every series the sim reports is one the real engine has, with the same labels.
    let real = fixture(METRICS_CHAT);
    let real: Vec<&str> = real["D_after_decode"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    for line in dm
        .lines()
        .filter(|l| !l.starts_with('#') && (l.contains("nixl") || l.contains("by_source")))
    {
        let series = line.rsplit_once(' ').unwrap().0;
        assert!(
            real.iter().any(|r| r.starts_with(&format!("{series} "))),
            "{series}"
        );
    }
}

#[tokio::test]
async fn vllm_streamed_decode_and_completions_keep_their_shapes() {
    let (p, d) = vllm_pair(1, PdConfig::default()).await;
    let p_fix = fixture(P_COMPL);
    let r = replay(p.addr, &p_fix, &p_fix["request"]["body"]).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let answer = r.json();
    assert_eq!(answer["id"], p_fix["response"]["body"]["id"]);
    let params = &answer["kv_transfer_params"];
    let rid = params["remote_request_id"].as_str().unwrap();
    assert!(
        rid.starts_with(&format!("{}-0-", answer["id"].as_str().unwrap())),
        "completions: {rid}"
    );

    let d_fix = fixture(D_COMPL);
    assert_eq!(d_fix["request"]["body"]["stream"], true);
    let r = replay(d.addr, &d_fix, &decode_body(&d_fix, params)).await;
    assert_eq!(r.status, 200);
    let text = String::from_utf8(r.body.to_vec()).unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(
        !text.contains("kv_transfer_params") && !text.contains("\"error\""),
        "{text}"
    );
    assert_eq!(
        d.pd_counts()[0].external_kv_transfer,
        params["remote_num_tokens"].as_u64().unwrap()
    );
    assert_eq!(p.pd_counts()[0].held_leases, 0);
}

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
async fn vllm_a_dp2_prefill_pinned_to_rank_1_names_rank_1_and_d_pulls_from_it() {
    let (p, d) = vllm_pair(2, PdConfig::default()).await;
    let p_fix = fixture(P_RANK1);
    assert_eq!(p_fix["request"]["headers"]["X-data-parallel-rank"], "1");
    let r = replay(p.addr, &p_fix, &p_fix["request"]["body"]).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["x-sim-rank"], "1");
    let params = r.json()["kv_transfer_params"].clone();
    assert_eq!(params["remote_engine_id"], format!("{}_dp1", p.engine_id()));
    assert_eq!(params["remote_port"], p.side_ports()[1]);
    assert_ne!(p.side_ports()[0], p.side_ports()[1]);
    assert_eq!(p.pd_counts()[1].held_leases, 1);
    assert!(p.kv_usage()[1] > 0.0 && p.kv_usage()[0] == 0.0);

    // Rank 0's side channel does not serve rank 1's blocks.
    let mut wrong = params.clone();
    wrong["remote_port"] = json!(p.side_ports()[0]);
    let d_fix = fixture(D_CHAT);
    let r = replay(d.addr, &d_fix, &decode_body(&d_fix, &wrong)).await;
    assert_eq!(r.status, 500);
    assert_eq!(
        p.pd_counts()[1].held_leases,
        1,
        "still held for the right pull"
    );
    let r = replay(d.addr, &d_fix, &decode_body(&d_fix, &params)).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(p.pd_counts()[1].held_leases, 0);
    assert_eq!(d.pd_counts()[0].transfers, 1);
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
