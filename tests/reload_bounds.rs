//! A reload's file is bounded over real sockets: a path that points at a FIFO, at `/dev/zero` or
//! at a file over `config::MAX_CONFIG_BYTES` is refused promptly with what it is, the fleet keeps
//! serving as it was, and a later valid reload still applies. A path that points at a file of
//! secrets (`/proc/self/environ`, a `.env`) is refused naming the line, never its text: in the
//! reload's answer and in `rankgate check`'s.

mod common;

use std::path::Path;
use std::time::Duration;

use common::admin::*;
use common::*;
use http::{Method, StatusCode};
use rankgate::app::Router;
use rankgate::config::{Config, MAX_CONFIG_BYTES};
use rankgate_sim::sim::SimConfig;
use serde_json::json;

/// "Answered at all while the file is hostile": far above what a refusal takes.
const PROMPTLY: Duration = Duration::from_secs(5);

/// `POST /reload`, its status and error message, answered within [`PROMPTLY`].
async fn reload(r: &Router) -> (StatusCode, String) {
    let reply = tokio::time::timeout(
        PROMPTLY,
        admin(r, Method::POST, "/reload", Some(TOKEN), None),
    )
    .await
    .expect("the reload is answered promptly");
    let msg = reply.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (reply.status, msg)
}

/// Puts `make`'s file (or link, or FIFO) where the config was.
fn replace(path: &Path, make: impl FnOnce(&Path)) {
    let _ = std::fs::remove_file(path);
    make(path);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_dev_zero_or_oversized_file_is_refused_and_a_later_reload_applies() {
    let a = engine(SimConfig::default()).await;
    let b = engine(sim(rankgate_sim::sim::SimFlavor::Vllm, 2, 2)).await;
    let head = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}{FAST}",
        token_env()
    );
    let valid = format!("{head}{}", engine_toml(&a.url(), "vllm", 2, 0));
    let file = TempConfig::new(&valid);
    let cfg = Config::load(&file.0).unwrap();
    let r = Router::start_from(cfg, Some(file.0.clone())).await.unwrap();
    wait_state(&r, &[0, 1], "available").await;

    // A named pipe nobody writes to: opening it to read would wait for a writer forever.
    replace(&file.0, |p| {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    });
    let (status, msg) = reload(&r).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{msg}");
    assert!(msg.contains("named pipe (FIFO)"), "{msg}");
    assert!(
        msg.contains(&*file.0.to_string_lossy()),
        "names the path: {msg}"
    );

    // Endless bytes, through a link (the link is followed, and what it leads to refused).
    replace(&file.0, |p| {
        std::os::unix::fs::symlink("/dev/zero", p).unwrap()
    });
    let (status, msg) = reload(&r).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{msg}");
    assert!(msg.contains("a character device"), "{msg}");

    // A valid TOML file one byte over the cap: many engines, refused before it is parsed.
    let mut big = head.clone();
    let mut n = 0;
    while big.len() as u64 <= MAX_CONFIG_BYTES {
        big.push_str(&format!(
            "[[engines]]\nurl = \"http://127.0.0.1:{}\"\n",
            1 + n % 60_000
        ));
        n += 1;
    }
    replace(&file.0, |p| std::fs::write(p, &big).unwrap());
    let (status, msg) = reload(&r).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{msg}");
    assert!(msg.contains("larger than a config file may be"), "{msg}");

    // The fleet served throughout, and a valid file still reloads.
    wait_state(&r, &[0, 1], "available").await;
    replace(&file.0, |p| {
        std::fs::write(p, format!("{valid}{}", engine_toml(&b.url(), "vllm", 2, 2))).unwrap()
    });
    let reply = admin(&r, Method::POST, "/reload", Some(TOKEN), None).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.json()["added"], json!([b.url()]));
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    r.shutdown().await;
}

#[test]
fn the_start_refuses_what_a_reload_refuses() {
    let err = Config::load(Path::new("/dev/zero"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("config file /dev/zero") && err.contains("a character device"),
        "{err}"
    );
    let err = Config::load(&std::env::temp_dir()).unwrap_err().to_string();
    assert!(err.contains("a directory"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_of_secrets_is_refused_by_its_line_never_its_text() {
    let a = engine(SimConfig::default()).await;
    let head = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}{FAST}",
        token_env()
    );
    let file = TempConfig::new(&format!("{head}{}", engine_toml(&a.url(), "vllm", 2, 0)));
    let cfg = Config::load(&file.0).unwrap();
    let r = Router::start_from(cfg, Some(file.0.clone())).await.unwrap();
    wait_state(&r, &[0, 1], "available").await;

    // The process's own environment, as a config path pointed at it reads.
    let environ = std::fs::read("/proc/self/environ").unwrap();
    let values: Vec<String> = (environ.split(|b| *b == 0))
        .filter_map(|kv| {
            Some(String::from_utf8_lossy(kv.splitn(2, |b| *b == b'=').nth(1)?).into_owned())
        })
        .filter(|v| v.len() >= 4)
        .collect();
    assert!(!values.is_empty());
    replace(&file.0, |p| {
        std::os::unix::fs::symlink("/proc/self/environ", p).unwrap()
    });
    let (status, msg) = reload(&r).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{msg}");
    assert!(msg.contains("line 1, column "), "{msg}");
    for v in &values {
        assert!(
            !msg.contains(v.as_str()),
            "the environment's {v:?} in {msg}"
        );
    }

    // A secret on line 3 of something that is no rankgate config.
    let secret = "sk-live-0123456789abcdef";
    let dotenv = format!("[server]\nlisten = \"127.0.0.1:0\"\nadmin_token = {secret}\n");
    replace(&file.0, |p| std::fs::write(p, &dotenv).unwrap());
    let (status, msg) = reload(&r).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{msg}");
    assert!(
        msg.contains("line 3, column 15, key `admin_token`"),
        "{msg}"
    );
    assert!(
        !msg.contains("sk-live") && !msg.contains("0123456789"),
        "{msg}"
    );
    // `rankgate check` says the same, and nothing more.
    let path = file.0.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_rankgate"))
            .args(["check", "--config"])
            .arg(&path)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("line 3, column 15") && !said.contains("sk-live"),
        "{said}"
    );
    // Served as it was throughout.
    wait_state(&r, &[0, 1], "available").await;
    r.shutdown().await;
}

/// A reload to thousands of engines that refuse every connection (issue 38: 20,000 such engines
/// once left a reload unanswered, `/ready` at 5-21 s and the real engines' ranks stale): it is
/// answered within its deadline, `/ready` keeps answering meanwhile, the two real engines'
/// ranks never leave "available", and a reload back to them applies promptly. The dead engines'
/// polls are paced (`telemetry::budget`), so they never take the runtime from the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_to_thousands_of_dead_engines_stalls_nothing_and_a_reload_back_applies() {
    const DEAD: usize = 3_000;
    let a = engine(SimConfig::default()).await;
    let b = engine(sim(rankgate_sim::sim::SimFlavor::Vllm, 2, 2)).await;
    let head = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}{FAST}",
        token_env()
    );
    let small = format!(
        "{head}{}{}",
        engine_toml(&a.url(), "vllm", 2, 0),
        engine_toml(&b.url(), "vllm", 2, 2)
    );
    // A port nobody listens on, on every loopback address below.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut big = small.clone();
    for i in 0..DEAD {
        big.push_str(&format!(
            "[[engines]]\nurl = \"http://127.1.{}.{}:{closed}\"\nflavor = \"vllm\"\n",
            i / 250,
            1 + i % 250
        ));
    }
    let file = TempConfig::new(&small);
    let r = Router::start_from(Config::load(&file.0).unwrap(), Some(file.0.clone()))
        .await
        .unwrap();
    wait_state(&r, &[0, 1, 2, 3], "available").await;

    // Watches /ready (every 50 ms) and the real ranks (every 200 ms) until told to stop.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let admin_addr = r.admin_addr;
    // The urls, not the engines: moved into the watcher, the engines went with it when it
    // ended, and the last check below then found them gone (connection refused).
    let (url_a, url_b) = (a.url(), b.url());
    let watcher = tokio::spawn({
        let stop = stop.clone();
        async move {
            let (mut probes, mut slowest, mut not_available) = (0u32, Duration::ZERO, Vec::new());
            let mut n = 0u32;
            // Bounded: 60 s at most, whatever the test does.
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && n < 1_200 {
                n += 1;
                let t = std::time::Instant::now();
                let ready = tokio::time::timeout(PROMPTLY, get(admin_addr, "/ready")).await;
                assert!(
                    ready.is_ok(),
                    "/ready unanswered for {PROMPTLY:?} during the reload"
                );
                probes += 1;
                slowest = slowest.max(t.elapsed());
                if n.is_multiple_of(4) {
                    let rows = get(admin_addr, "/workers").await.json();
                    let rows = rows.as_array().cloned().unwrap_or_default();
                    for row in rows.iter().filter(|w| {
                        let id = w["id"].as_str().unwrap_or("");
                        id.starts_with(&url_a) || id.starts_with(&url_b)
                    }) {
                        if row["telemetry"] != "available" {
                            not_available.push(format!("{}: {}", row["id"], row["telemetry"]));
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (probes, slowest, not_available)
        }
    });

    // `text` written and reloaded: answered 200 within the reload's own deadline (and a
    // moment), and the count of engines the answer lists under `key`.
    let reload_to = |text: String, key: &'static str| {
        file.write(&text);
        let generous = rankgate::control::RELOAD_DEADLINE + PROMPTLY;
        let r = &r;
        async move {
            let reply = tokio::time::timeout(
                generous,
                admin(r, Method::POST, "/reload", Some(TOKEN), None),
            )
            .await
            .unwrap_or_else(|_| panic!("a reload listing {key} engines unanswered"));
            assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
            reply.json()[key].as_array().map(Vec::len)
        }
    };
    assert_eq!(reload_to(big, "added").await, Some(DEAD));
    // The dead engines are polled for a while (longer than stale_after, 2 s): the real ranks
    // must stay fresh all along.
    tokio::time::sleep(Duration::from_secs(3)).await;

    assert_eq!(reload_to(small, "removed").await, Some(DEAD));
    let listed = get(r.admin_addr, "/engines").await.json();
    assert_eq!(listed.as_array().map(Vec::len), Some(2), "{listed}");

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (probes, slowest, not_available) = watcher.await.unwrap();
    assert!(probes > 10, "/ready was asked throughout ({probes} probes)");
    assert!(
        not_available.is_empty(),
        "the real ranks left \"available\" during the reload: {not_available:?}"
    );
    // Not a timing bound: "answered at all" with room for a loaded debug build.
    assert!(slowest < PROMPTLY, "/ready took {slowest:?}");
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    r.shutdown().await;
}
