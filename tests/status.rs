//! Status that never misleads, over real sockets: `/workers`' `kv_index` says `off` where no KV
//! events will come and its `models` are absent (`models_state: pending`) until known, never an
//! empty list; the start line counts the engines still to say their shape; `check --probe` names
//! each failed request, says `unknown` for what it could not learn and lists the ranks it did;
//! an engine that cannot say its shape is warned of once, not every poll; and a one-model fleet
//! answers a request for another model itself.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use common::binary::Rankgate;
use common::{
    engine, engine_toml, post_json, router, serving, sim, wait_models, wait_workers, FAST,
};
use rankgate_sim::sim::{SimConfig, SimFlavor};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WAIT: Duration = Duration::from_secs(10);

fn url_only(url: &str) -> String {
    format!("[[engines]]\nurl = \"{url}\"\n")
}

/// A URL nobody listens on: a port bound, read back, then closed.
fn closed_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_index_says_off_when_no_events_will_come() {
    // routing.kv_events off (the default): no rank's events are read.
    let e = engine(sim(SimFlavor::Vllm, 2, 0)).await;
    let r = router(FAST, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    let rows = wait_workers(&r, WAIT, |rows| rows.len() == 2).await;
    for w in &rows {
        assert_eq!(w["kv_index"]["state"], "off", "{w}");
        let why = w["kv_index"]["reason"].as_str().unwrap_or("");
        assert!(why.contains("routing.kv_events is off"), "{w}");
    }
    r.shutdown().await;

    // routing.kv_events on, but this engine publishes none (no /kv_event_sources): off, and
    // why; never "no KV events yet", which is for events configured that have not arrived.
    let r = router(
        &format!("{FAST}[routing]\nprefix_affinity = true\nkv_events = true\n"),
        &[engine_toml(&e.url(), "vllm", 2, 0)],
    )
    .await;
    let rows = wait_workers(&r, WAIT, |rows| {
        rows.len() == 2 && rows.iter().all(|w| w["kv_index"]["state"] == "off")
    })
    .await;
    for w in &rows {
        let why = w["kv_index"]["reason"].as_str().unwrap_or("");
        assert!(
            why.contains("no kv_events configured for this engine"),
            "{w}"
        );
    }
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_are_pending_until_known_never_an_empty_list() {
    let hung = engine(SimConfig {
        hang_models: true,
        ..sim(SimFlavor::Vllm, 1, 0)
    })
    .await;
    let fine = engine(sim(SimFlavor::Vllm, 1, 1)).await;
    let r = router(
        FAST,
        &[
            engine_toml(&hung.url(), "vllm", 1, 0),
            engine_toml(&fine.url(), "vllm", 1, 1),
        ],
    )
    .await;
    // Every answer on the way, the first included, is one of the two true shapes.
    let rows = wait_workers(&r, WAIT, |rows| {
        for w in rows {
            match w["models_state"].as_str() {
                Some("pending") => assert!(w.get("models").is_none(), "{w}"),
                Some("read") => assert_eq!(w["models"], json!(["tiny-llama"]), "{w}"),
                _ => panic!("models_state: {w}"),
            }
        }
        rows.iter()
            .any(|w| w["engine"] == fine.url() && w["models_state"] == "read")
    })
    .await;
    let of = |url: String| rows.iter().find(|w| w["engine"] == url).cloned().unwrap();
    assert_eq!(of(hung.url())["models_state"], "pending");
    r.shutdown().await;
}

/// The start line counts the engines whose shape is due; an engine that cannot say its shape is
/// warned of once (however its failures read), and said once when it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shapes_pending_are_counted_and_warned_of_once() {
    let shaped = engine(sim(SimFlavor::Vllm, 1, 0)).await;
    let asked = engine(sim(SimFlavor::Vllm, 2, 0)).await;
    let down = closed_port();
    let (flapper, accepted) = flapping_server().await;
    let down_url = format!("http://{down}");
    let flap_url = format!("http://{flapper}");
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nshutdown_delay = \"0s\"\n{FAST}{}{}{}{}",
        engine_toml(&shaped.url(), "vllm", 1, 0),
        url_only(&asked.url()),
        url_only(&down_url),
        url_only(&flap_url),
    );
    let mut rg = Rankgate::start("status-shapes", &config, None).await;
    let start = rg.wait_log("rankgate serving", WAIT).await;
    for part in ["engines=4", "workers=1", "engines_pending_shape=3"] {
        assert!(start.contains(part), "{part}: {start}");
    }
    let said = rg
        .wait_log(
            &format!("engine said its shape engine={} ", asked.url()),
            WAIT,
        )
        .await;
    for part in ["workers=3", "engines_pending_shape=2"] {
        assert!(said.contains(part), "{part}: {said}");
    }
    // Many polls of both (the flapping one answers each connection differently: closed, 503,
    // 500), bounded in time.
    common::until("30 connections to the flapping engine", WAIT, || {
        accepted.load(Relaxed) >= 30
    })
    .await;
    assert_eq!(warned(&rg, &down_url), 1, "{}", rg.log().join("\n"));
    assert_eq!(warned(&rg, &flap_url), 1, "{}", rg.log().join("\n"));

    // The down engine comes up on its port: said once, with the fleet's count.
    let up = SimConfig {
        dp_size: 1,
        ..sim(SimFlavor::Vllm, 1, 0)
    };
    let _up = rankgate_sim::sim::SimEngine::start(down, up).await.unwrap();
    let said = rg
        .wait_log(&format!("engine said its shape engine={down_url} "), WAIT)
        .await;
    assert!(said.contains("workers=4"), "{said}");
    assert_eq!(warned(&rg, &down_url), 1, "{}", rg.log().join("\n"));
    let recovered = rg.count("engine said its shape");
    assert_eq!(recovered, 2, "{}", rg.log().join("\n"));
}

/// How many times `rg` warned that the engine at `url` did not say its shape.
fn warned(rg: &Rankgate, url: &str) -> usize {
    let engine = format!("engine={url} ");
    (rg.log().iter())
        .filter(|l| l.contains("engine did not say its shape") && l.contains(&engine))
        .count()
}

/// A server that answers each connection's request differently in turn: closes it unanswered,
/// 503, 500. Returns its address and the connections it accepted.
async fn flapping_server() -> (SocketAddr, Arc<AtomicUsize>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = l.accept().await {
            let n = count.fetch_add(1, Relaxed);
            tokio::spawn(async move {
                // The request head, bounded in size and time.
                let mut buf = vec![0u8; 4096];
                let mut got = 0;
                let read = tokio::time::timeout(Duration::from_secs(2), async {
                    while got < buf.len() && !buf[..got].windows(4).any(|w| w == b"\r\n\r\n") {
                        match tcp.read(&mut buf[got..]).await {
                            Ok(0) | Err(_) => return,
                            Ok(k) => got += k,
                        }
                    }
                })
                .await;
                if read.is_err() {
                    return;
                }
                let status = match n % 3 {
                    0 => return,
                    1 => "503 Service Unavailable",
                    _ => "500 Internal Server Error",
                };
                let answer =
                    format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                let _ = tcp.write_all(answer.as_bytes()).await;
                let _ = tcp.shutdown().await;
            });
        }
    });
    (addr, accepted)
}

/// `check --probe` against an engine that is up (its ranks listed), one whose `/health`
/// answers while everything else hangs (reachable, each hung request named), and one that is
/// down (`unknown`, not a DP size of 0; the failed requests in `problems`, not in `models`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_probe_names_ranks_failed_requests_and_unknowns() {
    let up = engine(sim(SimFlavor::Vllm, 2, 0)).await;
    let hung = engine(SimConfig {
        hang_models: true,
        hang_metrics: true,
        ..sim(SimFlavor::Vllm, 1, 0)
    })
    .await;
    let down = format!("http://{}", closed_port());
    // Answers everything, but its /health says 503: reachable, unhealthy, serving nothing.
    let sick = engine(SimConfig {
        health_status: 503,
        ..sim(SimFlavor::Vllm, 1, 0)
    })
    .await;
    let path =
        std::env::temp_dir().join(format!("rankgate-status-probe-{}.toml", std::process::id()));
    let config = format!(
        "[telemetry]\ntimeout = \"300ms\"\n{}[[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\n{}{}",
        url_only(&up.url()),
        hung.url(),
        url_only(&down),
        url_only(&sick.url()),
    );
    std::fs::write(&path, config).unwrap();
    let run = path.clone();
    let o = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_rankgate"))
            .args(["check", "--probe", "--config"])
            .arg(&run)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let _ = std::fs::remove_file(&path);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(o.status.code(), Some(69), "{out}");
    let line_of = |url: &str| {
        out.lines()
            .find(|l| l.starts_with(&format!("{url}\treachable")))
            .unwrap_or("")
            .to_string()
    };
    let l = line_of(&up.url());
    let ranks = format!("ranks={0}@0,{0}@1\t", up.url());
    for part in [
        "reachable=yes",
        "health=ok",
        "flavor=vllm",
        "dp_size=2",
        &ranks,
        "models=tiny-llama",
    ] {
        assert!(l.contains(part), "{part}: {l}");
    }
    assert!(!l.contains("problems="), "{l}");

    let l = line_of(&hung.url());
    for part in [
        "reachable=yes",
        "dp_size=unknown",
        "ranks=unknown",
        "models=unknown",
        "GET /v1/models: no answer within 300 ms",
        "GET /metrics: no answer within 300 ms",
    ] {
        assert!(l.contains(part), "{part}: {l}");
    }

    let l = line_of(&down);
    for part in [
        "reachable=no",
        "dp_size=unknown",
        "ranks=unknown",
        "models=unknown\t",
        "problems=GET /health: ",
        "GET /v1/models: ",
    ] {
        assert!(l.contains(part), "{part}: {l}");
    }
    assert!(!l.contains("dp_size=0"), "{l}");
    // What it could not learn is `unknown`, with why; never `?`.
    assert!(l.contains("\tflavor=unknown (not configured"), "{l}");
    assert!(
        l.contains("\thealth=unknown (/health did not answer)"),
        "{l}"
    );
    assert!(!out.contains("flavor=?"), "{out}");

    // Reachable (as /workers says it) but unhealthy: its rank would get no traffic, so the
    // probe fails and says which engine and why.
    let l = line_of(&sick.url());
    for part in [
        "reachable=yes",
        "health=unhealthy (/health answered HTTP 503",
        "flavor=vllm",
    ] {
        assert!(l.contains(part), "{part}: {l}");
    }
    let said = String::from_utf8_lossy(&o.stderr);
    let sick_said = format!(
        "{}: its 1 rank(s) would get no traffic: reachable but unhealthy",
        sick.url()
    );
    assert!(said.contains(&sick_said), "{said}");
    assert!(
        said.contains(&format!(
            "{down}: its ranks would get no traffic: nothing answered"
        )),
        "{said}"
    );
    assert!(
        said.contains("3 of 4 engine(s) would serve nothing"),
        "{said}"
    );
}

/// A rank that never had numbers is logged as not having them yet, not as "still" without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_never_available_is_not_available_yet() {
    let down = format!("http://{}", closed_port());
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nshutdown_delay = \"0s\"\n{FAST}{}",
        engine_toml(&down, "vllm", 1, 0),
    );
    let mut rg = Rankgate::start("status-never", &config, None).await;
    let said = rg.wait_log("telemetry not available yet", WAIT).await;
    assert!(said.contains(&format!("worker={down}@0")), "{said}");
    let first = (rg.log().into_iter())
        .find(|l| l.contains("telemetry") && l.contains(&format!("{down}@0")))
        .unwrap_or_default();
    assert!(first.contains("telemetry not available yet"), "{first}");
}

/// One model served: a request naming another gets rankgate's own 404 `model_not_found`,
/// naming the model served, wherever `model` is in the body; the served one is served. An
/// engine whose list is still unknown keeps requests going to it (its own answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_model_fleet_answers_an_unknown_model_itself() {
    let e = engine(serving(&["tiny-llama"], 2, 0)).await;
    let r = router(FAST, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    wait_models(&r).await;
    let chat = |model: &str, first: bool| match first {
        true => {
            json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        }
        false => {
            json!({"messages": [{"role": "user", "content": "tiny-llama"}], "max_tokens": 2, "model": model})
        }
    };
    for first in [true, false] {
        let reply = post_json(r.addr, "/v1/chat/completions", chat("gpt-4", first)).await;
        // The OpenAI shape, its `code` the model's (as a fleet of several models answers).
        assert_eq!(reply.status, 404);
        let v = reply.json();
        assert_eq!(v["error"]["type"], "NotFoundError", "{v}");
        assert_eq!(v["error"]["code"], "model_not_found", "{v}");
        assert_eq!(v["error"]["param"], "model", "{v}");
        let msg = v["error"]["message"].as_str().unwrap_or("");
        assert!(
            msg.contains("gpt-4") && msg.contains("this fleet serves: tiny-llama"),
            "{msg}"
        );
        let reply = post_json(r.addr, "/v1/chat/completions", chat("tiny-llama", first)).await;
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
    }
    assert!(
        e.seen()
            .iter()
            .all(|s| s.model.as_deref() == Some("tiny-llama")),
        "no request for gpt-4 reached the engine"
    );
    r.shutdown().await;

    // Its list unknown (its /v1/models hangs): routed as before, the engine answers.
    let hung = engine(SimConfig {
        hang_models: true,
        ..sim(SimFlavor::Vllm, 1, 0)
    })
    .await;
    let r = router(FAST, &[engine_toml(&hung.url(), "vllm", 1, 0)]).await;
    wait_workers(&r, WAIT, |rows| {
        rows.iter().all(|w| w["telemetry"] == "available")
    })
    .await;
    let reply = post_json(r.addr, "/v1/chat/completions", chat("gpt-4", true)).await;
    assert_eq!(reply.status, 404);
    let body: Value = reply.json();
    let msg = body["error"]["message"].as_str().unwrap_or("");
    assert!(
        !msg.contains("this fleet serves"),
        "the engine's own: {msg}"
    );
    assert_eq!(
        hung.seen().last().and_then(|s| s.model.clone()).as_deref(),
        Some("gpt-4")
    );
    r.shutdown().await;
}
