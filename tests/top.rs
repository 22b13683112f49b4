//! `rankgate top` over real sockets and a recorded fleet: the recorded `/workers` document drawn
//! at 80x24 against the expected screen, and the poll-and-render loop run headless against a live
//! router while engines serve, die, leave the fleet, and the router itself goes away.
//!
//! The expected screen is regenerated (after a deliberate change of the view, then read by eye)
//! with `RANKGATE_BLESS=1 cargo test --test top`; the recorded document with
//! `cargo test --test top -- --ignored record_workers_fixture`.
#![cfg(all(feature = "top", feature = "sim"))]

mod common;

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use common::admin::{token_env, TOKEN};
use common::*;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use rankgate_sim::sim::SimFlavor;
use rankgate_top::model::short_id;
use rankgate_top::{render, State, Top};
use ratatui::backend::TestBackend;
use ratatui::buffer::Buffer;
use ratatui::style::Color;
use ratatui::Terminal;
use serde_json::Value;
use tokio::time::Instant;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The screen as text, one line per row, trailing blanks cut (a text file keeps no trailing
/// spaces reliably; every other cell is compared).
fn screen(buffer: &Buffer) -> String {
    let width = buffer.area.width as usize;
    let symbols: Vec<&str> = buffer.content.iter().map(|c| c.symbol()).collect();
    symbols
        .chunks(width.max(1))
        .map(|row| row.concat().trim_end().to_string() + "\n")
        .collect()
}

fn terminal(width: u16, height: u16) -> Terminal<TestBackend> {
    Terminal::new(TestBackend::new(width, height)).expect("test terminal")
}

fn draw(state: &State, term: &mut Terminal<TestBackend>) -> String {
    render(state, term).expect("render");
    screen(term.backend().buffer())
}

/// `/metrics` text in which the `i`th worker has served `n * (i + 1)` requests, or none if it
/// is unavailable: two of them a second apart give every rank a known rate.
fn metrics(rows: &[Value], n: u64) -> String {
    let mut text = String::from("# TYPE rankgate_requests_total counter\n");
    for (i, row) in rows.iter().enumerate() {
        let id = row["id"].as_str().unwrap_or_default();
        let served = if row["telemetry"] == "available" {
            i as u64 + 1
        } else {
            0
        };
        let ok = n * served;
        text.push_str(&format!(
            "rankgate_requests_total{{worker=\"{id}\",status=\"2xx\"}} {ok}\n\
             rankgate_requests_total{{worker=\"{id}\",status=\"5xx\"}} 0\n"
        ));
    }
    text
}

/// The recorded fleet, with rates from two synthetic `/metrics` readings 1 s apart.
fn recorded_state() -> State {
    let doc = std::fs::read(fixture("workers.json")).expect("tests/fixtures/workers.json");
    let rows: Vec<Value> = serde_json::from_slice(&doc).expect("recorded /workers is JSON");
    let mut state = State::new("http://127.0.0.1:9090", Duration::from_secs(1));
    let t0 = Instant::now();
    state.apply(t0, &doc, Ok(&metrics(&rows, 10))).unwrap();
    state
        .apply(t0 + Duration::from_secs(1), &doc, Ok(&metrics(&rows, 13)))
        .unwrap();
    state
}

#[test]
fn recorded_fleet_renders_at_80x24() {
    let state = recorded_state();
    // The document is what it should be for this test to mean anything.
    let rows = state.rows();
    assert!(rows.len() >= 4, "{rows:?}");
    assert!(rows.iter().any(|r| !r.available()), "no unavailable rank");
    let engines: std::collections::HashSet<&str> = rows.iter().map(|r| r.engine.as_str()).collect();
    assert!(engines.len() >= 2, "one engine only");

    let got = draw(&state, &mut terminal(80, 24));
    let path = fixture("top_80x24.txt");
    if std::env::var_os("RANKGATE_BLESS").is_some() {
        std::fs::write(&path, &got).expect("write the expected screen");
    }
    let want = std::fs::read_to_string(&path).expect("tests/fixtures/top_80x24.txt");
    assert!(
        got == want,
        "the 80x24 screen changed; if on purpose, look at it, then RANKGATE_BLESS=1 cargo test \
         --test top\n--- want\n{want}--- got\n{got}"
    );
    for line in got.lines() {
        assert!(line.chars().count() <= 80, "{line}");
    }
    // Colours are not in the text: the state column is green for a rank that takes traffic,
    // red for one that does not, and so is its reason.
    let mut term = terminal(80, 24);
    render(&state, &mut term).unwrap();
    let buffer = term.backend().buffer();
    for r in state.rows() {
        let id = short_id(&r.id, 25);
        let y = (got.lines().position(|l| l.starts_with(&id)))
            .unwrap_or_else(|| panic!("{id} not on screen")) as u16;
        let want = if r.available() {
            Color::Green
        } else {
            Color::Red
        };
        assert_eq!(buffer[(26, y)].fg, want, "{id}");
        if !r.available() {
            assert_eq!(buffer[(46, y)].fg, Color::Red, "{id}");
        }
    }
}

/// The recorded fleet as a disaggregated one: its first engine's ranks prefill, the others'
/// decode (the roles set on the recorded rows, the rest as recorded). Each rank's line carries
/// its side's mark at the end of the RANK column, the layout stays within 80 columns, and the
/// filter finds one side by its role.
#[test]
fn prefill_and_decode_ranks_are_told_apart_at_80x24() {
    let doc = std::fs::read(fixture("workers.json")).expect("tests/fixtures/workers.json");
    let mut rows: Vec<Value> = serde_json::from_slice(&doc).expect("recorded /workers is JSON");
    let first = rows[0]["engine"].clone();
    for row in &mut rows {
        row["role"] = if row["engine"] == first {
            "prefill"
        } else {
            "decode"
        }
        .into();
    }
    let doc = serde_json::to_vec(&rows).unwrap();
    let mut state = State::new("http://127.0.0.1:9090", Duration::from_secs(1));
    state
        .apply(Instant::now(), &doc, Ok(&metrics(&rows, 10)))
        .unwrap();
    let text = draw(&state, &mut terminal(80, 24));
    let title = text.lines().nth(2).unwrap();
    assert!(
        title.starts_with("RANK▼") && title.contains("P/D STATE"),
        "{text}"
    );
    for row in &rows {
        let id = row["id"].as_str().unwrap();
        let short = short_id(id, 23);
        let line = (text.lines().find(|l| l.starts_with(&short)))
            .unwrap_or_else(|| panic!("{id} not on screen:\n{text}"));
        let mark = if row["engine"] == first { 'P' } else { 'D' };
        assert_eq!(line.chars().nth(24), Some(mark), "{line}");
        assert!(line.chars().count() <= 80, "{line}");
    }
    let prefill = rows.iter().filter(|r| r["engine"] == first).count();
    state.filter = "prefill".into();
    assert_eq!(state.visible().len(), prefill, "{text}");
}

#[test]
fn recorded_fleet_sorted_filtered_stale_and_squeezed() {
    let mut state = recorded_state();
    let mut term = terminal(80, 24);
    let unavailable: Vec<String> = (state.rows().iter())
        .filter(|r| !r.available())
        .map(|r| short_id(&r.id, 25))
        .collect();

    // Sorted by state: the unavailable ranks come first, under the titles.
    state.sort = rankgate_top::SortKey::State;
    let text = draw(&state, &mut term);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[2].contains("STATE▼"), "{text}");
    // Rank lines, not the reasons' continuation lines (which start blank).
    let ranks: Vec<&str> = (lines[3..].iter())
        .filter(|l| !l.starts_with(' ') && !l.is_empty())
        .copied()
        .collect();
    for (i, id) in unavailable.iter().enumerate() {
        assert!(ranks[i].starts_with(id.as_str()), "{text}");
    }

    // Filtered by a model id: only that engine's ranks.
    let model = state.rows()[0].models[0].clone();
    let engine = state.rows()[0].engine.clone();
    state.filter = model.to_uppercase();
    let text = draw(&state, &mut term);
    for r in state.rows() {
        let shown = text.contains(&short_id(&r.id, 25));
        assert_eq!(shown, r.engine == engine, "{} in\n{text}", r.id);
    }
    state.filter.clear();

    // Unreachable: the last rows stay, and the status line says so.
    state.failed("Connection refused (os error 111)".into());
    let text = draw(&state, &mut term);
    let status = text.lines().nth(1).unwrap();
    assert!(
        status.contains("admin unreachable: Connection refused"),
        "{text}"
    );
    assert!(status.contains("stale"), "{text}");
    assert!(status.ends_with("1 failed"), "{text}");
    for r in state.rows() {
        assert!(text.contains(&short_id(&r.id, 25)), "{text}");
    }
    let dim = term.backend().buffer()[(0, 3)].modifier;
    assert!(
        dim.contains(ratatui::style::Modifier::DIM),
        "stale rows are dimmed"
    );

    // Smaller terminals clip, and nothing panics.
    for (w, h) in [(40, 10), (20, 5), (1, 1), (200, 60)] {
        draw(&state, &mut terminal(w, h));
    }
}

fn ids_of(rows: &[Value], engine: &str) -> Vec<String> {
    rows.iter()
        .filter(|r| r["engine"] == engine)
        .map(|r| r["id"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_fleet_through_engines_leaving_and_the_router_going() {
    let a = engine(serving(&["model-a"], 2, 0)).await;
    let b = engine(serving(&["model-b"], 2, 2)).await;
    a.set_kv_usage(vec![0.4, 0.2]);
    b.set_kv_usage(vec![0.8, 0.1]);
    let extra = format!("{}{FAST}", token_env());
    let r = router(
        &extra,
        &[
            engine_toml(&a.url(), "vllm", 2, 0),
            engine_toml(&b.url(), "vllm", 2, 2),
        ],
    )
    .await;
    let rows = wait_state(&r, &[0, 1, 2, 3], "available").await;
    let (a_ids, b_ids) = (ids_of(&rows, &a.url()), ids_of(&rows, &b.url()));
    wait_models(&r).await;

    let mut top = Top::new(
        &format!("http://{}", r.admin_addr),
        Duration::from_millis(200),
    )
    .expect("admin url");
    let mut term = terminal(80, 24);
    top.poll_once().await;
    let first = draw(top.state(), &mut term);
    assert!(!top.state().stale(), "{first}");
    // One reading of the counters: no rate yet.
    assert_eq!(top.state().totals().req_per_s, None, "{first}");

    // Traffic for both models between two polls: every rank that served shows a rate.
    for i in 0..24 {
        let model = if i % 2 == 0 { "model-a" } else { "model-b" };
        let body = serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        });
        let reply = send(
            post(r.addr, "/v1/chat/completions")
                .body(Full::new(Bytes::from(body.to_string())))
                .unwrap(),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    }
    top.poll_once().await;
    let text = draw(top.state(), &mut term);
    for id in a_ids.iter().chain(&b_ids) {
        assert!(text.contains(&short_id(id, 25)), "{id} missing:\n{text}");
    }
    let totals = top.state().totals();
    assert!(
        totals.req_per_s.is_some_and(|x| x > 0.0),
        "{totals:?}\n{text}"
    );
    let header = text.lines().next().unwrap();
    assert!(header.contains("ranks 4/4"), "{header}");
    assert!(!header.contains("req/s 0.0"), "{header}");
    assert!(header.contains(&r.admin_addr.to_string()), "{header}");

    // B dies: its ranks turn unavailable on the screen, with a reason, and nothing panics.
    b.kill().await;
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows.iter()
            .filter(|w| w["engine"] == b.url())
            .all(|w| w["telemetry"] == "unavailable")
    })
    .await;
    top.poll_once().await;
    let text = draw(top.state(), &mut term);
    for row in top.state().rows() {
        let line = text
            .lines()
            .find(|l| l.starts_with(&short_id(&row.id, 25)))
            .unwrap_or_else(|| panic!("{} missing:\n{text}", row.id));
        if row.engine == b.url() {
            assert!(!row.available() && row.reason.is_some(), "{row:?}");
            assert!(!line.contains(" ok "), "{line}");
        } else {
            assert!(line.contains(" ok "), "{line}");
        }
    }
    assert!(text.lines().next().unwrap().contains("ranks 2/4"), "{text}");

    // B leaves the fleet through the admin API: its rows go.
    let delete = Request::builder()
        .method(Method::DELETE)
        .uri(format!("http://{}/engines?url={}", r.admin_addr, b.url()))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let reply = send(delete).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    top.poll_once().await;
    let text = draw(top.state(), &mut term);
    assert_eq!(top.state().rows().len(), 2, "{text}");
    for id in &b_ids {
        assert!(
            !text.contains(&short_id(id, 25)),
            "{id} still shown:\n{text}"
        );
    }
    for id in &a_ids {
        assert!(text.contains(&short_id(id, 25)), "{id} missing:\n{text}");
    }

    // The router goes: the status line says so, the last rows stay, twice over.
    r.shutdown().await;
    for polls in 1..=2 {
        top.poll_once().await;
        let text = draw(top.state(), &mut term);
        let status = text.lines().nth(1).unwrap();
        assert!(top.state().stale(), "{text}");
        assert!(status.contains("admin unreachable"), "{text}");
        assert!(status.contains("stale"), "{text}");
        assert_eq!(top.state().outage.as_ref().unwrap().failures, polls);
        for id in &a_ids {
            assert!(text.contains(&short_id(id, 25)), "{id} missing:\n{text}");
        }
    }
    drop(a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_listening_and_not_an_admin() {
    // A port nothing listens on: unreachable from the first poll, no data, no panic.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let mut top = Top::new(&addr.to_string(), Duration::from_secs(1)).unwrap();
    top.poll_once().await;
    let text = draw(top.state(), &mut terminal(80, 24));
    assert!(text.contains("admin unreachable: "), "{text}");
    assert!(text.contains("no data yet"), "{text}");

    // The front door instead of the admin listener: refused as such, not drawn as a fleet.
    let (_e, r) = fleet(sim(SimFlavor::Vllm, 1, 0)).await;
    let mut top = Top::new(&format!("http://{}", r.addr), Duration::from_secs(1)).unwrap();
    top.poll_once().await;
    let text = draw(top.state(), &mut terminal(80, 24));
    assert!(top.state().stale(), "{text}");
    assert!(top.state().rows().is_empty(), "{text}");
    r.shutdown().await;
}

/// Records `tests/fixtures/workers.json` from a live fleet: a vLLM engine with two ranks, an
/// SGLang one with four (one of them missing from its `/metrics`), and an engine that is down;
/// a few streams are open while it is read, so ranks show running and in-flight requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes tests/fixtures/workers.json; run by hand to record a new one"]
async fn record_workers_fixture() {
    let a = engine(serving(&["meta-llama/Llama-3.1-8B-Instruct"], 2, 0)).await;
    let b = engine(rankgate_sim::sim::SimConfig {
        models: vec!["Qwen/Qwen2.5-7B-Instruct".into()],
        ..sim(SimFlavor::Sglang, 4, 2)
    })
    .await;
    a.set_kv_usage(vec![0.62, 0.18]);
    b.set_kv_usage(vec![0.93, 0.41, 0.77, 0.05]);
    b.set_dark_ranks(vec![5]);
    let down = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let down_url = format!("http://{}", down.local_addr().unwrap());
    drop(down);
    let r = router(
        FAST,
        &[
            engine_toml(&a.url(), "vllm", 2, 0),
            engine_toml(&b.url(), "sglang", 4, 2),
            engine_toml(&down_url, "vllm", 1, 6),
        ],
    )
    .await;
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows.iter()
            .filter(|w| w["telemetry"] == "available")
            .count()
            == 5
            && rows.iter().all(|w| w["reason_kind"] != "not_polled")
            && (rows.iter().filter(|w| w["engine"] != down_url.as_str()))
                .all(|w| w["models"].as_array().is_some_and(|m| !m.is_empty()))
    })
    .await;
    let mut streams = Vec::new();
    for model in [
        "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.1-8B-Instruct",
        "Qwen/Qwen2.5-7B-Instruct",
    ] {
        let body = serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 4000,
            "stream": true,
        });
        let s = client()
            .request(
                post(r.addr, "/v1/chat/completions")
                    .body(Full::new(Bytes::from(body.to_string())))
                    .unwrap(),
            )
            .await
            .expect("stream");
        assert_eq!(s.status(), StatusCode::OK);
        streams.push(s);
    }
    let rows = wait_workers(&r, Duration::from_secs(10), |rows| {
        let sum = |key: &str| rows.iter().filter_map(|w| w[key].as_u64()).sum::<u64>();
        sum("in_flight") == 3 && sum("num_running_reqs") >= 2
    })
    .await;
    let text = serde_json::to_string_pretty(&rows).unwrap() + "\n";
    std::fs::write(fixture("workers.json"), text).unwrap();
    drop(streams);
    r.shutdown().await;
}

/// The binary: bad arguments are named, and without a terminal it says so and exits at once
/// (never drawing escape codes into a pipe).
#[test]
fn the_subcommand_refuses_what_it_cannot_do() {
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_rankgate"))
            .arg("top")
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run rankgate top")
    };
    let o = run(&["--admin", "http://127.0.0.1:9"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("not a terminal"), "{err}");
    assert!(o.stdout.is_empty());

    let o = run(&["--admin", "ftp://127.0.0.1:9"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("http:// or https://"), "{err}");

    let o = run(&[
        "--admin",
        "https://127.0.0.1:9",
        "--ca-file",
        "/no/such/ca.pem",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("/no/such/ca.pem"), "{err}");

    let o = run(&["--admin", "http://127.0.0.1:9", "--interval", "10ms"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("within 100ms and 60s"), "{err}");
}

/// A dropped SSH session: `top` runs on a pty as its controlling terminal, draws, and then the
/// pty's other end is closed. It must end within a few seconds (it once spun a core forever,
/// deaf to SIGHUP, SIGTERM and SIGINT, joining an input thread stuck on the dead terminal).
#[test]
fn top_ends_when_its_terminal_goes_away() {
    use std::io::Read;
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty writes two descriptors it opened, which are then owned here.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // Neither end may leak into a child (top itself included): an open master keeps the
    // terminal alive.
    for fd in [master, slave] {
        // SAFETY: fcntl on descriptors this test owns.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rankgate"));
    cmd.args(["top", "--admin", "http://127.0.0.1:9"])
        .stdin(Stdio::from(slave.try_clone().unwrap()))
        .stdout(Stdio::from(slave.try_clone().unwrap()))
        .stderr(Stdio::from(slave));
    // SAFETY: only async-signal-safe calls between fork and exec. A session of its own with the
    // pty as controlling terminal, as a shell's child in an SSH session has.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            libc::ioctl(0, libc::TIOCSCTTY as _, 0);
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("start rankgate top");
    drop(cmd);
    // Wait until it has drawn (switched to the alternate screen), read on a thread so the wait
    // is bounded.
    let mut reader = std::fs::File::from(master);
    let (tx, rx) = std::sync::mpsc::channel();
    let read = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        let n = reader.read(&mut buf).unwrap_or(0);
        let _ = tx.send(n);
        reader // closed when the test drops it
    });
    let drew = rx.recv_timeout(Duration::from_secs(20)).unwrap_or(0);
    let master = read.join().unwrap();
    assert!(drew > 0, "top drew nothing");
    drop(master); // the terminal goes away
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let status = status.expect("top still running 10 s after its terminal went away");
    assert_ne!(status.code(), Some(101), "it panicked on the way out");
}
