//! `rankgate top` over real sockets and a recorded fleet: the recorded `/workers` document drawn
//! at 80x24 against the expected screen, and the poll-and-render loop run headless against a live
//! router while engines serve, die, leave the fleet, and the router itself goes away.
//!
//! The expected screen is regenerated (after a deliberate change of the view, then read by eye)
//! with `RANKGATE_BLESS=1 cargo test --test top`; the recorded document with
//! `cargo test --test top -- --ignored record_workers_fixture`.
#![cfg(all(feature = "top", feature = "sim"))]

mod cli;
#[path = "../common/mod.rs"]
mod common;
mod live;

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
    // The rank id takes what the fixed columns leave of 80: 18 columns; STATE starts at 19,
    // FAIL at 27.
    for r in state.rows() {
        let id = short_id(&r.id, 18);
        let y = (got.lines().position(|l| l.starts_with(&id)))
            .unwrap_or_else(|| panic!("{id} not on screen")) as u16;
        let want = if r.available() {
            Color::Green
        } else {
            Color::Red
        };
        assert_eq!(buffer[(19, y)].fg, want, "{id}");
        // A rank failing its requests says so in red even while its telemetry reads ok (the
        // recorded rank @3 has 4 consecutive 500s).
        let line = got.lines().nth(y as usize).unwrap_or_default();
        if r.consecutive_failures > 0 {
            assert!(line.contains(" 4 500 "), "{line}");
            assert_eq!(buffer[(27, y)].fg, Color::Red, "{id}");
        }
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
        let short = short_id(id, 16);
        let line = (text.lines().find(|l| l.starts_with(&short)))
            .unwrap_or_else(|| panic!("{id} not on screen:\n{text}"));
        let mark = if row["engine"] == first { 'P' } else { 'D' };
        assert_eq!(line.chars().nth(17), Some(mark), "{line}");
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
        .map(|r| short_id(&r.id, 18))
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
        let shown = text.contains(&short_id(&r.id, 18));
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
        assert!(text.contains(&short_id(&r.id, 18)), "{text}");
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
