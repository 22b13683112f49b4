//! Both legs of a disaggregated request: vLLM's chat and completions, streamed or not, prefill on
//! one rank and decode on another; each side picks its own least-loaded rank; an engine killed on
//! each side mid-run fails no request; a failing rank is failed over on its own side; SGLang's two
//! legs at once, the room landing on the prefill rank rankgate chose.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use rankgate_sim::sim::{SimEngine, SimFlavor};
use serde_json::{json, Value};

use crate::common::*;
use crate::helpers::*;

fn usage_prompt_tokens(v: &Value) -> u64 {
    v["usage"]["prompt_tokens"]
        .as_u64()
        .expect("usage.prompt_tokens")
}

/// The whole body of a reply, and for a stream its events' JSON (the last with usage).
async fn body_of(resp: http::Response<hyper::body::Incoming>) -> (u16, Bytes) {
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, bytes)
}

fn events(body: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(body)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("event JSON"))
        .collect()
}

async fn ask(addr: std::net::SocketAddr, path: &'static str, body: Value) -> (u16, Bytes) {
    let req = post(addr, path)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    body_of(client().request(req).await.expect("request")).await
}

#[tokio::test]
async fn vllm_chat_and_completions_streamed_or_not_prefill_on_one_rank_and_decode_on_another() {
    let (p, d, r) = pd_fleet(SimFlavor::Vllm, 1, 1, 1, "").await;
    let mut pulled = 0;
    for (path, stream) in [
        ("/v1/chat/completions", false),
        ("/v1/chat/completions", true),
        ("/v1/completions", false),
        ("/v1/completions", true),
    ] {
        let mut body = match path {
            "/v1/completions" => {
                json!({"model": "tiny-llama", "prompt": "the quick brown fox jumps over the lazy dog"})
            }
            _ => {
                json!({"model": "tiny-llama", "messages": [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]})
            }
        };
        body["max_tokens"] = json!(6);
        body["stream"] = json!(stream);
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        // A client's own transfer parameters never reach an engine: these would send the
        // decode to a prefill server that does not exist.
        body["kv_transfer_params"] =
            json!({"do_remote_prefill": true, "remote_host": "10.255.0.1", "remote_port": 1});
        let (status, bytes) = ask(r.addr, path, body).await;
        assert_eq!(
            status,
            200,
            "{path} stream={stream}: {}",
            String::from_utf8_lossy(&bytes)
        );
        let usage = match stream {
            true => events(&bytes).last().cloned().expect("a usage event"),
            false => serde_json::from_slice(&bytes).expect("JSON answer"),
        };
        let prompt = usage_prompt_tokens(&usage);
        assert!(prompt > 0);
        pulled += prompt;
        // The decode server was handed the prompt's KV: it computed none of it.
        let dc = d[0].pd_counts()[0];
        assert_eq!(dc.external_kv_transfer, pulled, "{path} stream={stream}");
        assert_eq!(dc.local_compute, 0);
    }
    // Every block the prefill server lent was pulled, so none is held.
    until("prefill leases released", Duration::from_secs(5), || {
        p[0].pd_counts()[0].held_leases == 0
    })
    .await;
    let pc = p[0].pd_counts()[0];
    assert_eq!(pc.local_compute, pulled);
    // The prefill leg was pinned to its rank like any request.
    assert!(p[0]
        .seen()
        .iter()
        .all(|s| s.rank_header.as_deref() == Some("0")));
    let metrics = get(r.admin_addr, "/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body).to_string();
    assert!(text.contains("rankgate_pd_decoded_total 4"), "{text}");
    let legs = format!(
        "rankgate_pd_legs_total{{worker=\"{}@0\",leg=\"prefill\"}} 4",
        p[0].url()
    );
    assert!(text.contains(&legs), "{text}");
    r.shutdown().await;
}

#[tokio::test]
async fn each_side_picks_its_own_least_loaded_rank_and_the_loaded_ranks_get_no_legs() {
    let (p, d, r) = pd_fleet(SimFlavor::Vllm, 2, 2, 2, "").await;
    // One prefill rank and one decode rank really are busy: long requests sent to them
    // directly fill their KV and queues.
    let mut background = Vec::new();
    for (e, rank) in [(&p[0], 0), (&d[1], 1)] {
        for _ in 0..24 {
            let body = json!({"model": "tiny-llama", "prompt": "word ".repeat(200),
                "max_tokens": 20000, "stream": true});
            let req = post(e.addr, "/v1/completions")
                .header("x-data-parallel-rank", rank.to_string())
                .body(Full::new(Bytes::from(body.to_string())))
                .unwrap();
            background.push(tokio::spawn(async move {
                if let Ok(resp) = client().request(req).await {
                    let _ = resp.into_body().collect().await;
                }
            }));
        }
    }
    let loaded = [format!("{}@0", p[0].url()), format!("{}@1", d[1].url())];
    // Generous: on a machine busy with other builds the ranks fill slowly (one run on a
    // loaded 2-core machine took over 20 s).
    wait_workers(&r, Duration::from_secs(60), |rows| {
        rows.iter()
            .filter(|w| loaded.contains(&w["id"].as_str().unwrap_or_default().to_string()))
            .all(|w| w["kv_usage"].as_f64().is_some_and(|k| k > 0.6))
    })
    .await;
    const N: usize = 100;
    let mut done = 0;
    for chunk in 0..N / 10 {
        let answers = all((0..10).map(|i| {
            let body = json!({"model": "tiny-llama", "prompt": format!("request {chunk} {i}"), "max_tokens": 2});
            ask(r.addr, "/v1/completions", body)
        }))
        .await;
        for (status, bytes) in answers {
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
            done += 1;
        }
    }
    assert_eq!(done, N);
    for b in background {
        b.abort();
    }
    // The background requests were sent straight to the engines, not through rankgate.
    let routed = |s: &&rankgate_sim::sim::Seen| s.peer.is_some_and(|_| s.request_id.is_some());
    let legs = |e: &SimEngine, rank: u32| {
        e.seen()
            .iter()
            .filter(routed)
            .filter(|s| s.rank == rank)
            .count()
    };
    let on_loaded = legs(&p[0], 0) + legs(&d[1], 1);
    let prefill: usize = p.iter().map(|e| legs(e, 0) + legs(e, 1)).sum();
    let decode: usize = d.iter().map(|e| legs(e, 0) + legs(e, 1)).sum();
    assert_eq!((prefill, decode), (N, N));
    // At most 2% of the legs reach either loaded rank.
    let spread: Vec<(String, usize)> = (p.iter().chain(&d))
        .flat_map(|e| (0..2).map(move |k| (format!("{}@{k}", e.url()), legs(e, k))))
        .collect();
    assert!(
        on_loaded * 100 <= 2 * 2 * N,
        "{on_loaded} legs on the loaded ranks {loaded:?}: {spread:?}"
    );
    r.shutdown().await;
}

#[tokio::test]
async fn an_engine_killed_on_each_side_mid_run_fails_no_request() {
    // What is tested is that every request a dead engine held is failed over to the
    // survivors, which takes up to three retries each (the prefill's transport failure, the
    // decode's 500 once its prefill is gone and once more on another decode rank, a new round
    // from the other prefill). With 40 in flight at the kill, that is about what the default
    // budget allows (20% of ~180 legs plus the floor of 20): a slow run spent it (48 retries,
    // 3 refused, in 2 of 6 runs of this binary beside the suite). The budget's own bound is
    // `tests/faults` `retry_budget_caps_extra_load_when_everything_fails`; here it is lifted.
    let (p, d, r) = pd_fleet(SimFlavor::Vllm, 2, 2, 2, "[routing]\nretry_budget = 1.0").await;
    let addr = r.addr;
    let run = move |k: usize| {
        let body =
            json!({"model": "tiny-llama", "prompt": format!("request {k}"), "max_tokens": 16});
        ask(addr, "/v1/completions", body)
    };
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    let first = all((0..20).map(run)).await;
    // Both sides lose an engine while requests are in flight on every rank.
    let during = all((20..60).map(run));
    let kill = async {
        tokio::time::sleep(Duration::from_millis(30)).await;
        tokio::join!(p[0].kill(), d[0].kill());
    };
    let (during, ()) = tokio::join!(during, kill);
    let after = all((60..80).map(run)).await;
    for (status, bytes) in first.into_iter().chain(during).chain(after) {
        *statuses.entry(status).or_default() += 1;
        if status != 200 {
            let m = get(r.admin_addr, "/metrics").await;
            let text = String::from_utf8_lossy(&m.body).to_string();
            let pd: Vec<&str> = text
                .lines()
                .filter(|l| {
                    (l.starts_with("rankgate_pd_failures") || l.starts_with("rankgate_retries"))
                        && !l.ends_with(" 0")
                })
                .collect();
            panic!(
                "{status} {}\n{pd:?}\n{}",
                String::from_utf8_lossy(&bytes),
                serde_json::to_string_pretty(&workers(&r).await).unwrap()
            );
        }
    }
    assert_eq!(statuses[&200], 80);
    // The survivors took what the dead took.
    assert!(
        p[1].pd_counts()
            .iter()
            .map(|c| c.local_compute)
            .sum::<u64>()
            > 0
    );
    assert!(
        d[1].pd_counts()
            .iter()
            .map(|c| c.external_kv_transfer)
            .sum::<u64>()
            > 0
    );
    r.shutdown().await;
}

#[tokio::test]
async fn sglang_both_legs_at_once_and_the_room_lands_on_the_prefill_rank_rankgate_chose() {
    let (p, d, r) = pd_fleet(SimFlavor::Sglang, 1, 1, 2, "").await;
    // Prefill rank 0 is loaded: every prefill leg goes to rank 1, and the room says so.
    p[0].set_kv_usage(vec![0.9, 0.0]);
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows.iter()
            .any(|w| w["kv_usage"].as_f64().is_some_and(|k| k > 0.8))
    })
    .await;
    for stream in [false, true] {
        for k in 0..4 {
            let body = json!({"model": "tiny-llama", "messages": [{"role": "user", "content": format!("hello {k}")}],
                "max_tokens": 4, "stream": stream, "bootstrap_room": 0});
            let (status, bytes) = ask(r.addr, "/v1/chat/completions", body).await;
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        }
    }
    // The prefill server served every room on rank 1, the rank rankgate chose (the room
    // decides it there, as SGLang's decode side finds it).
    let seen = p[0].seen();
    assert_eq!(seen.len(), 8);
    assert!(seen.iter().all(|s| s.rank == 1), "{seen:?}");
    let transfers: u64 = d[0].pd_counts().iter().map(|c| c.transfers).sum();
    assert_eq!(transfers, 8);
    r.shutdown().await;
}

#[tokio::test]
async fn a_failing_prefill_or_decode_rank_is_failed_over_on_its_own_side() {
    // Every failed leg may be retried here (the budget is the subject of other tests).
    let budget = "[routing]\nretry_budget = 1.0\n";
    let (p, d, r) = pd_fleet(SimFlavor::Vllm, 2, 2, 1, budget).await;
    // One server on each side answers every request 503 before doing anything.
    p[0].set_fail(503, 100.0).expect("fault");
    d[0].set_fail(503, 100.0).expect("fault");
    let addr = r.addr;
    let answers = all((0..20).map(|k| {
        let body =
            json!({"model": "tiny-llama", "prompt": format!("request {k}"), "max_tokens": 4});
        ask(addr, "/v1/completions", body)
    }))
    .await;
    for (status, bytes) in answers {
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    }
    let text = metrics_text(&r).await;
    for e in [&p[0], &d[0]] {
        let failed = format!(
            "rankgate_upstream_attempts_total{{worker=\"{}@0\",result=\"server_error\"}}",
            e.url()
        );
        let line = text
            .lines()
            .find(|l| l.starts_with(&failed))
            .unwrap_or_default();
        assert!(
            !line.is_empty() && !line.ends_with(" 0"),
            "{failed} not met: {text}"
        );
    }
    // Every decode pulled its prompt from the prefill server that served it, with the
    // parameters that server returned: the healthy ones did all the work, and no block is
    // left held (a decode failed over kept its prefill's parameters).
    let pulled: u64 = d[1].pd_counts().iter().map(|c| c.transfers).sum();
    assert_eq!(pulled, 20);
    until("prefill leases released", Duration::from_secs(5), || {
        p[1].pd_counts()[0].held_leases == 0
    })
    .await;
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("rankgate_pd_failures_total") && !l.ends_with(" 0")),
        "{text}"
    );
    r.shutdown().await;
}
