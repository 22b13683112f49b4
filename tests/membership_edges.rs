//! Runtime membership at its edges, from an attack review: edits and source changes that must
//! not make an engine unroutable, a discovered engine coming back when the file lets it go, and
//! config errors that `check` must catch like `serve`.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::admin::*;
use common::*;
use http::{Method, StatusCode};
use rankgate::app::Router;
use rankgate::config::Config;
use rankgate_sim::sim::SimConfig;
use serde_json::Value;

/// `(url, origin)` of every engine, from `GET /engines`.
async fn engines(r: &Router) -> Vec<(String, String)> {
    match get(r.admin_addr, "/engines").await.json() {
        Value::Array(rows) => rows
            .iter()
            .map(|e| {
                (
                    e["url"].as_str().unwrap_or("").to_string(),
                    e["origin"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect(),
        other => panic!("/engines is not an array: {other}"),
    }
}

/// A reload that changes only a non-identity key of an engine (here `models`, which the engine
/// already serves) must not make its ranks unknown: its workers carry on with their telemetry.
/// Otherwise every request fails with 503 until the new poller's first poll lands (one
/// `/metrics` round trip: up to seconds on a saturated vLLM), and `/ready` flips to 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_edits_an_engines_keys_keeps_its_ranks_routable() {
    let a = engine(SimConfig::default()).await;
    let head = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n{}\
         [telemetry]\ninterval = \"100ms\"\nstale_after = \"5s\"\n",
        token_env()
    );
    let file = TempConfig::new(&format!("{head}{}", engine_toml(&a.url(), "vllm", 2, 0)));
    let r = Router::start_from(Config::load(&file.0).unwrap(), Some(file.0.clone()))
        .await
        .unwrap();
    wait_state(&r, &[0, 1], "available").await;
    // Polls now take 1.5 s, as on a busy engine; the last numbers stay fresh (stale_after 5 s).
    a.set_metrics_delay(Duration::from_millis(1500));
    assert_eq!(chat(r.addr, 2).await.status, StatusCode::OK);

    file.write(&format!(
        "{head}{}models = [\"tiny-llama\"]\n",
        engine_toml(&a.url(), "vllm", 2, 0)
    ));
    let reply = admin(&r, Method::POST, "/reload", Some(TOKEN), None).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);

    let ready = get(r.admin_addr, "/ready").await.status;
    let reply = chat(r.addr, 2).await;
    assert_eq!(
        (reply.status, ready),
        (StatusCode::OK, StatusCode::OK),
        "the same engine, one key edited, became unroutable: {}",
        String::from_utf8_lossy(&reply.body)
    );
    a.set_metrics_delay(Duration::ZERO);
    r.shutdown().await;
}

/// The file naming an engine the admin API added, with the very same keys, changes nothing
/// about that engine: its ranks stay routable, and the reload reports it changed, not added and
/// removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_the_file_takes_over_from_the_admin_api_stays_routable() {
    let a = engine(SimConfig::default()).await;
    let head = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n{}\
         [telemetry]\ninterval = \"100ms\"\nstale_after = \"5s\"\n",
        token_env()
    );
    let file = TempConfig::new(&head);
    let r = Router::start_from(Config::load(&file.0).unwrap(), Some(file.0.clone()))
        .await
        .unwrap();
    let body = serde_json::json!({"url": a.url(), "flavor": "vllm", "dp_size": 2, "start_rank": 0});
    assert_eq!(
        admin(&r, Method::POST, "/engines", Some(TOKEN), Some(body))
            .await
            .status,
        StatusCode::OK
    );
    wait_state(&r, &[0, 1], "available").await;
    a.set_metrics_delay(Duration::from_millis(1500));

    file.write(&format!("{head}{}", engine_toml(&a.url(), "vllm", 2, 0)));
    let reply = admin(&r, Method::POST, "/reload", Some(TOKEN), None).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(engines(&r).await, [(a.url(), "config".to_string())]);

    let reply = chat(r.addr, 2).await;
    assert_eq!(
        reply.status,
        StatusCode::OK,
        "an unchanged engine moved from admin to config became unroutable: {}",
        String::from_utf8_lossy(&reply.body)
    );
    a.set_metrics_delay(Duration::ZERO);
    r.shutdown().await;
}

/// `http://:8000` has no host: refused, rather than polled and failing with a DNS error forever.
#[test]
fn an_engine_url_without_a_host_is_refused() {
    let err = Config::from_str("[[engines]]\nurl = \"http://:8000\"\nflavor = \"vllm\"\n");
    assert!(err.is_err(), "accepted an engine url without a host");
}

/// A DNS discovery name that is not a DNS name is a config error at load (and in `rankgate
/// check`), not a discovery that never starts and an empty fleet for good.
#[test]
fn a_dns_discovery_name_that_is_not_a_dns_name_is_refused_at_load() {
    let err = Config::from_str(
        "[[discovery]]\nkind = \"dns\"\nname = \"-bad..name\"\nport = 8000\nflavor = \"vllm\"\n",
    );
    assert!(err.is_err(), "accepted a DNS name with an empty label");
}

/// README: "`rankgate check` and `rankgate serve` exit with code 64 on any config error, naming
/// the file, the key and the problem": a `server.admin_token_env` naming an unset variable too.
#[test]
fn an_unset_admin_token_variable_is_a_config_error_for_check_and_serve() {
    let var = format!("RANKGATE_ATTACK_UNSET_{}", std::process::id());
    let file = TempConfig::new(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\nadmin_token_env = \"{var}\"\n"
    ));
    let bin = env!("CARGO_BIN_EXE_rankgate");
    let check = Command::new(bin)
        .args(["check", "--config"])
        .arg(&file.0)
        .env_remove(&var)
        .output()
        .unwrap();
    let mut serve = Command::new(bin)
        .args(["serve", "--config"])
        .arg(&file.0)
        .env_remove(&var)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let serve_status = loop {
        if let Some(s) = serve.try_wait().unwrap() {
            break s.code();
        }
        if Instant::now() > deadline {
            let _ = serve.kill();
            let _ = serve.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        (check.status.code(), serve_status),
        (Some(64), Some(64)),
        "check: {}",
        String::from_utf8_lossy(&check.stderr)
    );
}
