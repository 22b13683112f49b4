//! Fleets as they are deployed, over real sockets: several independent vLLM servers, each its own
//! DP deployment with ranks 0 and 1 (the recorded vLLM 0.32 capture served by each), configured
//! by url and flavor alone, added through the admin API, or beside a deployment spread over two
//! servers; and engines that say their flavor and size themselves.

mod common;

use common::admin::{admin, token_env, TOKEN};
use common::recorded::{kv_shown, six_ranks_least_kv, RecordedVllm, WAIT};
use common::{chat, router, router_with, wait_available, wait_workers, workers, FAST};

use http::{Method, StatusCode};
use rankgate::app::Router;
use rankgate_sim::sim::SimFlavor;
use serde_json::{json, Value};
use std::time::Duration;

fn url_only(url: &str) -> String {
    format!("[[engines]]\nurl = \"{url}\"\n")
}

fn url_and_flavor(url: &str) -> String {
    format!("[[engines]]\nurl = \"{url}\"\nflavor = \"vllm\"\n")
}

async fn three_servers() -> [RecordedVllm; 3] {
    [
        RecordedVllm::start().await,
        RecordedVllm::start().await,
        RecordedVllm::start().await,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_independent_servers_by_url_and_flavor() {
    let e = three_servers().await;
    let engines: Vec<String> = e.iter().map(|s| url_and_flavor(&s.url())).collect();
    let r = router(FAST, &engines).await;
    six_ranks_least_kv(&r, &e).await;
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_independent_servers_through_the_admin_api() {
    let e = three_servers().await;
    let r = router_with(&token_env(), FAST, &[]).await;
    for s in &e {
        let body = json!({"url": s.url(), "flavor": "vllm"});
        let reply = admin(&r, Method::POST, "/engines", Some(TOKEN), Some(body)).await;
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
    }
    six_ranks_least_kv(&r, &e).await;
    // The same URL twice is the one conflict.
    let again = json!({"url": e[0].url(), "flavor": "vllm"});
    let reply = admin(&r, Method::POST, "/engines", Some(TOKEN), Some(again)).await;
    assert_eq!(reply.status, StatusCode::CONFLICT);
    r.shutdown().await;
}

/// A deployment spread over two servers (ranks 0-1 and 2-3, global, as vLLM's hybrid DP labels
/// and accepts them) beside an independent server (0-1): each read and pinned its own way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_server_group_beside_an_independent_server() {
    let a = RecordedVllm::start().await;
    let b = RecordedVllm::start_on(common::loopback(), 2).await.unwrap();
    let c = RecordedVllm::start().await;
    let member = |s: &RecordedVllm, start: u32| {
        format!(
            "{}dp_size = 2\ndp_group = \"big\"\nstart_rank = {start}\n",
            url_and_flavor(&s.url())
        )
    };
    let r = router(
        FAST,
        &[member(&a, 0), member(&b, 2), url_and_flavor(&c.url())],
    )
    .await;
    let mut ids = wait_available(&r, |ids| ids.len() == 6).await;
    ids.sort();
    let mut want = vec![
        format!("{}@0", a.url()),
        format!("{}@1", a.url()),
        format!("{}@2", b.url()),
        format!("{}@3", b.url()),
        format!("{}@0", c.url()),
        format!("{}@1", c.url()),
    ];
    want.sort();
    assert_eq!(ids, want);

    a.set_kv([0.6, 0.6]);
    b.set_kv([0.5, 0.1]);
    c.set_kv([0.5, 0.5]);
    let shown = [
        (format!("{}@3", b.url()), 0.1),
        (format!("{}@0", c.url()), 0.5),
        (format!("{}@1", a.url()), 0.6),
    ];
    kv_shown(&r, &shown).await;
    assert_eq!(chat(r.addr, 2).await.worker(), format!("{}@3", b.url()));
    assert_eq!(b.pins(), ["3"], "a member is pinned with its global rank");

    b.set_kv([0.9, 0.9]);
    c.set_kv([0.5, 0.05]);
    let shown = [
        (format!("{}@3", b.url()), 0.9),
        (format!("{}@1", c.url()), 0.05),
    ];
    kv_shown(&r, &shown).await;
    assert_eq!(chat(r.addr, 2).await.worker(), format!("{}@1", c.url()));
    assert_eq!(c.pins(), ["1"], "an independent server with its own rank");
    assert_eq!((a.refused(), b.refused(), c.refused()), (0, 0, 0));
    r.shutdown().await;

    // Two members claiming the same rank of the group: a config error naming both.
    let text = format!("{}{}", member(&a, 0), member(&b, 1));
    let err = rankgate::config::Config::from_str(&text)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&a.url()) && err.contains(&b.url()) && err.contains("DP group \"big\""),
        "{err}"
    );
}

fn engine_row<'a>(rows: &'a [Value], url: &str) -> &'a Value {
    rows.iter()
        .find(|e| e["url"] == url)
        .unwrap_or_else(|| panic!("{url} not in /engines: {rows:?}"))
}

async fn engines(r: &Router) -> Vec<Value> {
    match common::get(r.admin_addr, "/engines").await.json() {
        Value::Array(v) => v,
        other => panic!("/engines is not an array: {other}"),
    }
}

/// Waits until `/engines` shows `url` with this flavor and size, and returns its row.
async fn shaped(r: &Router, url: &str, flavor: &str, dp_size: u64) -> Value {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let rows = engines(r).await;
        let row = engine_row(&rows, url).clone();
        if row["flavor"] == flavor && row["dp_size"] == dp_size {
            return row;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{url} not shaped {flavor} x {dp_size}: {row}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `/engines` shows what `url` reported of itself, and returns its row.
async fn reported(r: &Router, url: &str) -> Value {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let row = engine_row(&engines(r).await, url).clone();
        if !row["reported"].is_null() {
            return row;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{url} reported nothing: {row}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Flavor and DP size read from the engine: the recorded vLLM over HTTP (its /version and its
/// /metrics labels), a simulated SGLang over HTTP (/get_server_info), and vLLM and SGLang
/// engines known only by their gRPC address (GetServerInfo).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flavor_and_size_are_read_from_the_engines() {
    let v = RecordedVllm::start().await;
    let s = common::engine(common::sim(SimFlavor::Sglang, 3, 0)).await;
    let gv = common::grpc::Eng::start(SimFlavor::Vllm, 4, 0).await;
    let gs = common::grpc::Eng::start(SimFlavor::Sglang, 2, 0).await;
    let engines_toml = [
        url_only(&v.url()),
        url_only(&s.url()),
        format!("[[engines]]\ngrpc_url = \"{}\"\n", gv.url()),
        format!("[[engines]]\ngrpc_url = \"{}\"\n", gs.url()),
    ];
    let r = router_with("grpc_listen = \"127.0.0.1:0\"\n", FAST, &engines_toml).await;
    let row = shaped(&r, &v.url(), "vllm", 2).await;
    assert_eq!(row["reported"]["from"], "/metrics engine labels", "{row}");
    assert_eq!(row["configured"]["flavor"], Value::Null);
    shaped(&r, &s.url(), "sglang", 3).await;
    shaped(&r, &gv.url(), "vllm", 4).await;
    shaped(&r, &gs.url(), "sglang", 2).await;
    // 2 + 3 + 4 + 2 ranks, all read and routable.
    wait_available(&r, |ids| ids.len() == 11).await;
    v.set_kv([0.0, 0.0]);
    s.set_kv_usage(vec![0.9; 3]);
    let shown: Vec<_> = (0..3).map(|i| (format!("{}@{i}", s.url()), 0.9)).collect();
    kv_shown(&r, &shown).await;
    // Both serve the model: the request may go to either, by load.
    wait_workers(&r, WAIT, |rows| {
        rows.iter()
            .filter(|w| w["engine"] == v.url())
            .all(|w| w["models"] == json!(["tiny-llama"]))
    })
    .await;
    let reply = chat(r.addr, 2).await;
    assert_eq!(reply.status, 200);
    assert!(reply.worker().starts_with(&v.url()), "{}", reply.worker());
    r.shutdown().await;
}

/// The config says 4 ranks where the servers run fewer. An SGLang server says its size outright
/// (`dp_size` in its server info): its count wins, 2 workers. A vLLM server's ranks are read
/// from its /metrics labels, where a rank may just have no series yet: its 4 configured ranks
/// stay, the 2 it does not label unavailable with that reason. Either way no request goes to a
/// rank the server does not run, and the disagreement shows in /workers and /engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_size_the_engine_contradicts_is_shown_and_never_routed_blind() {
    let v = RecordedVllm::start().await;
    let s = common::engine(common::sim(SimFlavor::Sglang, 2, 0)).await;
    let sglang = format!(
        "[[engines]]\nurl = \"{}\"\nflavor = \"sglang\"\ndp_size = 4\n",
        s.url()
    );
    let r = router(
        FAST,
        &[format!("{}dp_size = 4\n", url_and_flavor(&v.url())), sglang],
    )
    .await;
    let row = shaped(&r, &s.url(), "sglang", 2).await;
    let s_note = row["mismatch"].as_str().unwrap_or_default().to_string();
    assert!(
        s_note.contains("configured dp_size 4") && s_note.contains("reports 2"),
        "{row}"
    );
    let row = reported(&r, &v.url()).await;
    assert_eq!(row["dp_size"], 4, "{row}");
    let v_note = row["mismatch"].as_str().unwrap_or_default().to_string();
    assert!(v_note.contains("name only 2"), "{row}");
    let ids = wait_available(&r, |ids| ids.len() == 4).await;
    assert!(
        ids.iter().all(|i| i.ends_with("@0") || i.ends_with("@1")),
        "{ids:?}"
    );
    let rows = workers(&r).await;
    for w in &rows {
        let note = if w["engine"] == v.url() {
            &v_note
        } else {
            &s_note
        };
        assert_eq!(w["engine_note"], note.as_str(), "{w}");
    }
    for rank in [2, 3] {
        let w = rows
            .iter()
            .find(|w| w["id"] == format!("{}@{rank}", v.url()))
            .unwrap();
        assert_eq!(w["telemetry"], "unavailable", "{w}");
    }
    for _ in 0..6 {
        assert_eq!(chat(r.addr, 2).await.status, 200);
    }
    assert_eq!(v.refused(), 0);
    r.shutdown().await;
}

/// An engine that never says what it is (a port that accepts and never answers) has no workers
/// and takes no traffic; /workers says why, and the fleet's other engine serves everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_does_not_say_its_size_takes_no_traffic_and_says_why() {
    let (mute_url, held) = common::mute_engine().await;
    let v = RecordedVllm::start().await;
    let r = router(
        "[telemetry]\ninterval = \"50ms\"\nstale_after = \"2s\"\ntimeout = \"300ms\"\n",
        &[url_only(&mute_url), url_and_flavor(&v.url())],
    )
    .await;
    let rows = wait_workers(&r, WAIT, |rows| {
        rows.iter().any(|w| {
            w["id"] == mute_url.as_str()
                && w["reason"]
                    .as_str()
                    .is_some_and(|s| s.contains("no answer"))
        })
    })
    .await;
    let row = rows.iter().find(|w| w["id"] == mute_url.as_str()).unwrap();
    assert_eq!(row["reason_kind"], "shape_unknown", "{row}");
    assert_eq!(row["telemetry"], "unavailable");
    assert!(
        row["reason"]
            .as_str()
            .unwrap()
            .starts_with("flavor and DP size not known yet"),
        "{row}"
    );
    wait_available(&r, |ids| ids.len() == 2).await;
    for _ in 0..5 {
        let reply = chat(r.addr, 2).await;
        assert_eq!(reply.status, 200);
        assert!(reply.worker().starts_with(&v.url()));
    }
    let e = engines(&r).await;
    assert_eq!(engine_row(&e, &mute_url)["dp_size"], 0);
    assert!(engine_row(&e, &mute_url)["unshaped"].is_string());
    r.shutdown().await;

    // Alone, it leaves a request nowhere to go, and the 503 says why: not "no engine".
    let alone = router(
        "[telemetry]\ninterval = \"50ms\"\nstale_after = \"2s\"\ntimeout = \"300ms\"\n",
        &[url_only(&mute_url)],
    )
    .await;
    let reply = chat(alone.addr, 2).await;
    assert_eq!(reply.status, 503);
    let body = String::from_utf8_lossy(&reply.body);
    assert!(body.contains("has said what it is yet"), "{body}");
    alone.shutdown().await;
    held.abort();
}

/// A server restarted with another DP size (a rollout from 2 to 3 ranks on the same port): once
/// it answers again rankgate asks it anew, and routes its 3 ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restarted_with_another_size_is_asked_again() {
    let first = common::engine(common::sim(SimFlavor::Vllm, 2, 0)).await;
    let url = first.url();
    let r = router(FAST, &[url_only(&url)]).await;
    shaped(&r, &url, "vllm", 2).await;
    wait_available(&r, |ids| ids.len() == 2).await;
    let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    first.kill().await;
    wait_available(&r, |ids| ids.is_empty()).await;
    let second = rankgate_sim::sim::SimEngine::start(addr, common::sim(SimFlavor::Vllm, 3, 0))
        .await
        .expect("the port is free again");
    shaped(&r, &url, "vllm", 3).await;
    let ids = wait_available(&r, |ids| ids.len() == 3).await;
    assert!(ids.contains(&format!("{url}@2")), "{ids:?}");
    assert_eq!(chat(r.addr, 2).await.status, 200);
    r.shutdown().await;
    second.shutdown().await;
}

/// A rank without a series in /metrics (starting, or publishing nothing) is no proof the server
/// runs fewer ranks: with dp_size configured it stays a worker, unavailable for want of
/// telemetry, with no disagreement reported; counted from the labels alone, the server's size
/// grows once the rank's series appears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_missing_from_the_labels_is_unavailable_not_gone() {
    let dark = || rankgate_sim::sim::SimConfig {
        dark_ranks: vec![1],
        ..common::sim(SimFlavor::Vllm, 2, 0)
    };
    let (a, b) = (common::engine(dark()).await, common::engine(dark()).await);
    let r = router(
        FAST,
        &[
            format!("{}dp_size = 2\n", url_and_flavor(&a.url())),
            url_only(&b.url()),
        ],
    )
    .await;
    let row = reported(&r, &a.url()).await;
    assert_eq!(
        (row["dp_size"].as_u64(), row["reported"]["dp_size"].as_u64()),
        (Some(2), Some(1)),
        "{row}"
    );
    shaped(&r, &b.url(), "vllm", 1).await;
    let rows = wait_workers(&r, WAIT, |rows| {
        rows.iter().any(|w| {
            w["id"] == format!("{}@1", a.url())
                && w["reason"].as_str().is_some_and(|s| s.contains("rank 1"))
        })
    })
    .await;
    assert_eq!(rows.len(), 3, "a@0, a@1 (unavailable) and b@0");
    // The dark rank lights up: the server counted from its labels has 2 ranks now.
    b.set_dark_ranks(vec![]);
    shaped(&r, &b.url(), "vllm", 2).await;
    wait_available(&r, |ids| ids.contains(&format!("{}@1", b.url()))).await;
    r.shutdown().await;
}

/// `rankgate check --probe` reads each engine once: the recorded vLLM (url only), a simulated
/// SGLang, and a port nobody listens on, which makes it exit 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_probe_reads_each_engine_once() {
    let v = RecordedVllm::start().await;
    let s = common::engine(common::sim(SimFlavor::Sglang, 2, 0)).await;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let dir = std::env::temp_dir().join(format!("rankgate-probe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |engines: Vec<String>, name: &str| {
        let path = dir.join(name);
        std::fs::write(&path, engines.concat()).unwrap();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(env!("CARGO_BIN_EXE_rankgate"))
                .args(["check", "--probe", "--config"])
                .arg(&path)
                .output()
                .unwrap()
        })
    };
    let sglang = format!("[[engines]]\nurl = \"{}\"\nflavor = \"sglang\"\n", s.url());
    let o = run(vec![url_only(&v.url()), sglang.clone()], "up.toml")
        .await
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let l = line_of(&out, &v.url());
    for part in [
        "reachable=yes",
        "flavor=vllm",
        "dp_size=2",
        "models=tiny-llama",
        "telemetry=prometheus: 2/2 ranks",
        "kv_events=no",
    ] {
        assert!(l.contains(part), "{part}: {l}");
    }
    let l = line_of(&out, &s.url());
    for part in [
        "reachable=yes",
        "flavor=sglang",
        "dp_size=2",
        "telemetry=http: 2/2 ranks",
    ] {
        assert!(l.contains(part), "{part}: {l}");
    }
    let o = run(vec![url_only(&v.url()), url_only(&closed)], "down.toml")
        .await
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(o.status.code(), Some(69), "{out}");
    assert!(line_of(&out, &closed).contains("reachable=no"), "{out}");
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(
        said.contains("would get no traffic: nothing answered"),
        "{said}"
    );
    assert!(
        said.contains("1 of 2 engine(s) would serve nothing"),
        "{said}"
    );
}

/// The probe's line for `url` (empty when there is none, which every assertion on it catches).
fn line_of<'a>(out: &'a str, url: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(&format!("{url}\treachable")))
        .unwrap_or("")
}
