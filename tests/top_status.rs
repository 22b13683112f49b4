//! `rankgate top`'s status that never misleads, over real sockets and ratatui's `TestBackend`:
//! after two readings of `/metrics` every rank has a REQ/S figure (a rank that never served is
//! 0.0 like one that went idle; `-` only while no rate is known yet), and an error too long for
//! the status line is wrapped whole below it, the rows still in view; a prefill rank's legs are
//! its load, as a decode rank's are; with flow control on, the router's queue is shown by
//! objective while a request waits.
#![cfg(all(feature = "top", feature = "sim"))]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::StatusCode;
use http_body_util::Full;
use rankgate_sim::sim::SimFlavor;
use rankgate_top::model::short_id;
use rankgate_top::{render, State, Top};
use ratatui::backend::TestBackend;
use ratatui::Terminal;

/// The screen as text, one line per row, trailing blanks cut.
fn draw(state: &State, term: &mut Terminal<TestBackend>) -> String {
    render(state, term).expect("render");
    let buffer = term.backend().buffer();
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

/// The REQ/S cell of `id`'s line: the column right after IN-FLIGHT.
fn req_per_s(text: &str, id: &str) -> String {
    let short = short_id(id, 18);
    let line = (text.lines().find(|l| l.starts_with(&short)))
        .unwrap_or_else(|| panic!("{id} not on screen:\n{text}"));
    let cells: Vec<&str> = line[short.len()..].split_whitespace().collect();
    // STATE, FAIL, INFL, REQ/S, ...
    cells[3].to_string()
}

/// One engine of two ranks, rank 1 at 95% KV: `least_kv` sends everything to rank 0.
async fn one_idle_rank() -> (rankgate_sim::sim::SimEngine, rankgate::app::Router, Top) {
    let (e, r) = fleet(sim(SimFlavor::Vllm, 2, 0)).await;
    e.set_kv_usage(vec![0.1, 0.95]);
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows.len() == 2 && rows[1]["kv_usage"] == 0.95 && rows[0]["kv_usage"] == 0.1
    })
    .await;
    let top = Top::new(
        &format!("http://{}", r.admin_addr),
        Duration::from_millis(200),
    )
    .expect("admin url");
    (e, r, top)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_never_served_reads_0_like_one_gone_idle() {
    let (e, r, mut top) = one_idle_rank().await;
    let (busy, idle) = (format!("{}@0", e.url()), format!("{}@1", e.url()));
    let mut term = terminal(80, 24);
    top.poll_once().await;
    let first = draw(top.state(), &mut term);
    // One reading: no rate is known for any rank, and every one says so alike.
    assert_eq!(req_per_s(&first, &busy), "-", "{first}");
    assert_eq!(req_per_s(&first, &idle), "-", "{first}");
    // Flow control is off: no queue line, the titles right under the status line.
    assert!(
        first.lines().nth(2).is_some_and(|l| l.starts_with("RANK")),
        "{first}"
    );
    assert!(top.state().queue().is_none());

    for _ in 0..6 {
        let reply = send(
            post(r.addr, "/v1/chat/completions")
                .body(Full::new(Bytes::from(chat_body(2, false))))
                .unwrap(),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.worker(), busy, "least_kv keeps off the full rank");
    }
    // The idle rank has no series in /metrics at all: it never answered a request.
    let metrics = get(r.admin_addr, "/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body);
    let series = format!("worker=\"{idle}\"");
    assert!(
        !(text.lines()).any(|l| l.starts_with("rankgate_requests_total{") && l.contains(&series)),
        "{text}"
    );

    top.poll_once().await;
    let second = draw(top.state(), &mut term);
    let rate: f64 = req_per_s(&second, &busy).parse().expect("a rate");
    assert!(rate > 0.0, "{second}");
    assert_eq!(req_per_s(&second, &idle), "0.0", "{second}");
    let rows = top.state().rows();
    assert_eq!(rows[1].req_per_s, Some(0.0), "{rows:?}");

    // Another reading with no traffic: both idle, both 0.0, told apart from "unknown" the same way.
    top.poll_once().await;
    let third = draw(top.state(), &mut term);
    assert_eq!(req_per_s(&third, &busy), "0.0", "{third}");
    assert_eq!(req_per_s(&third, &idle), "0.0", "{third}");
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_admin_error_is_wrapped_whole_with_the_rows_in_view() {
    let (e, r, mut top) = one_idle_rank().await;
    top.poll_once().await;
    let error = format!(
        "invalid peer certificate: Other(OtherError(CaUsedAsEndEntity)): {}",
        rankgate::tls::CA_AS_SERVER_ADVICE
    );
    top.state_mut().failed(error.clone());
    for (w, h) in [(80u16, 24u16), (120, 30)] {
        let text = draw(top.state(), &mut terminal(w, h));
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[1].contains("admin unreachable"), "{text}");
        assert!(lines[1].ends_with("1 failed"), "{text}");
        // The whole message, between the status line and the titles, nothing cut.
        let titles = (lines.iter().position(|l| l.starts_with("RANK")))
            .unwrap_or_else(|| panic!("no titles:\n{text}"));
        let below: Vec<&str> = lines[2..titles].iter().map(|l| l.trim()).collect();
        let want = format!("admin unreachable: {error}");
        assert_eq!(
            below.join(" "),
            want.split_whitespace().collect::<Vec<_>>().join(" "),
            "{text}"
        );
        assert!(below.iter().all(|l| !l.contains('…')), "{text}");
        assert!(
            lines.iter().all(|l| l.chars().count() <= w as usize),
            "{text}"
        );
        // The rows are still there, under it.
        for id in [format!("{}@0", e.url()), format!("{}@1", e.url())] {
            assert!(text.contains(&short_id(&id, 25)), "{id} missing:\n{text}");
        }
    }
    // A short error still fits on the status line, and nothing is added below it.
    top.state_mut()
        .failed("Connection refused (os error 111)".into());
    let text = draw(top.state(), &mut terminal(80, 24));
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[1].contains("admin unreachable: Connection refused (os error 111)"),
        "{text}"
    );
    assert!(lines[2].starts_with("RANK"), "{text}");
    r.shutdown().await;
}

/// A disaggregated fleet: each leg counts on the rank that served it, so after requests the
/// prefill rank's REQ/S is not 0.0 (its legs answer no client), nor is the decode rank's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_legs_show_as_load_on_their_rank() {
    use rankgate_sim::sim::{PdRole, SimConfig};
    let side = |role| SimConfig {
        role: Some(role),
        decode_tokens_per_sec: 2000.0,
        ..sim(SimFlavor::Vllm, 1, 0)
    };
    let p = engine(side(PdRole::Prefill)).await;
    let d = engine(side(PdRole::Decode)).await;
    let table = |e: &rankgate_sim::sim::SimEngine, role: &str| {
        format!(
            "[[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\ndp_size = 1\nrole = \"{role}\"\n",
            e.url()
        )
    };
    let r = router(FAST, &[table(&p, "prefill"), table(&d, "decode")]).await;
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows.len() == 2 && rows.iter().all(|w| w["telemetry"] == "available")
    })
    .await;
    wait_models(&r).await;
    let mut top = Top::new(
        &format!("http://{}", r.admin_addr),
        Duration::from_millis(200),
    )
    .expect("admin url");
    top.poll_once().await;
    for _ in 0..4 {
        let reply = send(
            post(r.addr, "/v1/chat/completions")
                .body(Full::new(Bytes::from(chat_body(2, false))))
                .unwrap(),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK);
    }
    top.poll_once().await;
    let rows = top.state().rows();
    let rate = |url: String| {
        (rows.iter().find(|w| w.id == format!("{url}@0")))
            .and_then(|w| w.req_per_s)
            .unwrap_or_else(|| panic!("{url}@0 has no rate: {rows:?}"))
    };
    assert!(rate(p.url()) > 0.0, "the prefill rank's legs: {rows:?}");
    assert!(rate(d.url()) > 0.0, "the decode rank's legs: {rows:?}");
    r.shutdown().await;
}

/// With `[flow]` on and the one rank busy (`flow.max_running = 1`), a request waits in the
/// router: top's queue line says so, by objective, highest priority first; once it has gone on,
/// the next poll tells how long it waited. A router without flow control has no such line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flow_queue_shows_while_a_request_waits() {
    use rankgate_sim::sim::SimConfig;
    // 20 tokens a second: a request of 30 tokens holds the rank for a second and a half.
    let e = engine(SimConfig {
        decode_tokens_per_sec: 20.0,
        ..sim(SimFlavor::Vllm, 1, 0)
    })
    .await;
    let flow = "[flow]\nenabled = true\nmax_running = 1\n\
        [[flow.objectives]]\nname = \"batch\"\npriority = -10\n";
    let r = router(
        &format!("{FAST}{flow}"),
        &[engine_toml(&e.url(), "vllm", 1, 0)],
    )
    .await;
    wait_state(&r, &[0], "available").await;
    let mut top = Top::new(
        &format!("http://{}", r.admin_addr),
        Duration::from_millis(200),
    )
    .expect("admin url");
    let mut term = terminal(80, 24);
    top.poll_once().await;
    let idle = draw(top.state(), &mut term);
    assert!(
        idle.lines().any(|l| l == " queue: default 0 · batch 0"),
        "{idle}"
    );

    let chat = |tokens| {
        tokio::spawn(send(
            post(r.addr, "/v1/chat/completions")
                .body(Full::new(Bytes::from(chat_body(tokens, false))))
                .unwrap(),
        ))
    };
    let blocker = chat(30);
    wait_workers(&r, Duration::from_secs(5), |rows| rows[0]["in_flight"] == 1).await;
    let waiter = chat(1);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let waiting = loop {
        top.poll_once().await;
        let text = draw(top.state(), &mut term);
        if text.lines().any(|l| l.starts_with(" queue: default 1")) {
            break text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the queue never showed the waiting request:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let lines: Vec<&str> = waiting.lines().collect();
    // Under the status line, above the titles; the rank's row still in view.
    assert!(
        lines[2].starts_with(" queue: default 1 · batch 0"),
        "{waiting}"
    );
    assert!(lines[3].starts_with("RANK"), "{waiting}");
    assert!(
        waiting.contains(&short_id(&format!("{}@0", e.url()), 18)),
        "{waiting}"
    );

    for h in [blocker, waiter] {
        assert_eq!(h.await.unwrap().status, StatusCode::OK);
    }
    // The request went on since the last poll: the queue is empty, and its wait is told.
    top.poll_once().await;
    let after = draw(top.state(), &mut term);
    let queue = (after.lines().find(|l| l.starts_with(" queue:")))
        .unwrap_or_else(|| panic!("no queue line:\n{after}"));
    assert!(queue.starts_with(" queue: default 0 (wait "), "{after}");
    let objectives = top.state().queue().expect("flow control is on");
    assert_eq!(objectives[0].name, "default");
    assert!(
        objectives[0].mean_wait.is_some_and(|w| w > 0.0),
        "{objectives:?}"
    );
    assert_eq!(objectives[0].refused_per_s, Some(0.0), "{objectives:?}");
    r.shutdown().await;
}
