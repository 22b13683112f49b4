//! Prefill/decode disaggregation through the router, over real sockets, against simulated
//! prefill and decode servers that speak vLLM's NIXL "pull" protocol and SGLang's bootstrap
//! one: each request goes to a prefill rank and a decode rank, each chosen by its own side's
//! load; the client gets the decode's answer; failures on either side are failed over or
//! counted, never a silent recompute.
#![cfg(feature = "sim")] // the simulated engine

mod common;

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use common::admin::{token_env, TOKEN};
use common::*;
use http_body_util::{BodyExt, Full};
use rankgate::app::Router;
use rankgate_sim::sim::{PdConfig, PdRole, SimConfig, SimEngine, SimFlavor};
use serde_json::{json, Value};

fn side(flavor: SimFlavor, role: Option<PdRole>, dp_size: u32) -> SimConfig {
    SimConfig {
        role,
        decode_tokens_per_sec: 2000.0,
        ..sim(flavor, dp_size, 0)
    }
}

/// One `[[engines]]` table for a server that is its own DP deployment, with its role.
fn role_toml(e: &SimEngine, flavor: &str, dp_size: u32, role: &str) -> String {
    let extra = match (flavor, role, e.bootstrap_port()) {
        ("sglang", "prefill", Some(port)) => format!("bootstrap_port = {port}\n"),
        _ => String::new(),
    };
    format!(
        "[[engines]]\nurl = \"{}\"\nflavor = \"{flavor}\"\ndp_size = {dp_size}\nrole = \"{role}\"\n{extra}",
        e.url()
    )
}

/// `p` prefill and `d` decode servers of `dp` ranks each behind a router with fast telemetry.
async fn pd_fleet(
    flavor: SimFlavor,
    p: usize,
    d: usize,
    dp: u32,
    server: &str,
) -> (Vec<SimEngine>, Vec<SimEngine>, Router) {
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    for _ in 0..p {
        prefill.push(engine(side(flavor, Some(PdRole::Prefill), dp)).await);
    }
    for _ in 0..d {
        decode.push(engine(side(flavor, Some(PdRole::Decode), dp)).await);
    }
    let f = flavor.as_str();
    let tables: Vec<String> = (prefill.iter().map(|e| role_toml(e, f, dp, "prefill")))
        .chain(decode.iter().map(|e| role_toml(e, f, dp, "decode")))
        .collect();
    let r = router_with(server, FAST, &tables).await;
    let n = (p + d) * dp as usize;
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows.len() == n && rows.iter().all(|w| w["telemetry"] == "available")
    })
    .await;
    wait_models(&r).await;
    (prefill, decode, r)
}

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

/// Runs the requests at once; their answers in order.
async fn all(
    requests: impl IntoIterator<Item = impl std::future::Future<Output = (u16, Bytes)> + Send + 'static>,
) -> Vec<(u16, Bytes)> {
    let tasks: Vec<_> = requests.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.expect("request task"));
    }
    out
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
    let (p, d, r) = pd_fleet(SimFlavor::Vllm, 2, 2, 2, "").await;
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
                .filter(|l| l.starts_with("rankgate_pd_failures") && !l.ends_with(" 0"))
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

async fn metrics_text(r: &Router) -> String {
    String::from_utf8_lossy(&get(r.admin_addr, "/metrics").await.body).to_string()
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
        .contains("rankgate_pd_abandoned_total 1")
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
