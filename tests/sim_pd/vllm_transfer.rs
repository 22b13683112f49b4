//! The simulated vLLM's prefill/decode transfer against the captured exchanges: P then D moves the
//! prompt's KV and releases it, a streamed decode and completions keep their shapes, and a DP=2
//! prefill pinned to rank 1 names rank 1 and D pulls from it.

use rankgate_sim::sim::PdConfig;
use serde_json::{json, Value};

use crate::helpers::*;

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

fn by_source(source: &str) -> String {
    format!(
        "vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"tiny-llama\",source=\"{source}\"}}"
    )
}

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
