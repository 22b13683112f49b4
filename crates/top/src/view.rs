//! Drawing `rankgate top`: one [`State`] into one ratatui [`Frame`], nothing else (no clock read,
//! no input), so a recorded fleet renders to the same cells every time and the snapshot test can
//! compare them.
//!
//! The layout is made for 80x24 over SSH: a header line of fleet totals and the admin URL, a
//! status line (sort, filter, or why the data is stale; an error it cannot hold is wrapped on
//! the lines below it, see [`super::status`]), with flow control the queue by objective
//! ([`super::queue`]), the column titles, one line per rank and a line
//! of keys. Columns are fixed-width text, widest first for the rank id; an
//! unavailable rank has no load figures, so its reason takes their place (and up to two lines
//! below, when every rank still fits on the screen) and is never hidden.

use ratatui::layout::{Constraint, Layout, Position, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;
use tokio::time::Instant;

use super::model::{short_id, truncate, Row, SortKey, State};
use super::queue::{max_lines, queue_lines};
use super::status::{status_height, status_lines, Paging};

/// Widths of the fixed columns; the rank id takes the rest.
const STATE_W: usize = 7;
/// Consecutive failures and their kind: `5 503`, `3 hung`.
const FAIL_W: usize = 6;
const INFL_W: usize = 4;
const REQS_W: usize = 6;
/// The bar, a space, then `100%`.
const BAR_W: usize = 8;
const KV_W: usize = BAR_W + 5;
const RUN_W: usize = 4;
const WAIT_W: usize = 4;
const SRC_W: usize = 4;
const AGE_W: usize = 5;
/// The columns after the id, with the space before each.
const FIXED_W: usize =
    STATE_W + FAIL_W + INFL_W + REQS_W + KV_W + RUN_W + WAIT_W + SRC_W + AGE_W + 9;
/// Where an unavailable rank's reason goes: the load columns, KV to AGE.
const REASON_W: usize = KV_W + RUN_W + WAIT_W + SRC_W + AGE_W + 4;
/// Lines that are not rank rows: header, status, titles, keys.
const CHROME_H: u16 = 4;
/// Most lines an unavailable rank's reason takes when there is room.
const REASON_LINES: usize = 3;

/// How many rank rows fit in a terminal `height` lines high (for paging).
pub fn rows_on_screen(height: u16) -> usize {
    height.saturating_sub(CHROME_H) as usize
}

/// Draws the whole screen. `now` only ages the stale data's timestamp.
pub fn draw(frame: &mut Frame, state: &State, now: Instant) {
    let status_h = status_height(state, now, frame.area().width, frame.area().height);
    let queue = queue_lines(state, frame.area().width, max_lines(frame.area().height));
    let [header, status, queue_area, titles, body, keys] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(status_h),
        Constraint::Length(queue.len() as u16),
        Constraint::Length(1),
        Constraint::Min(0),
        Constraint::Length(1),
    ])
    .areas(frame.area());
    let id_w = (frame.area().width as usize)
        .saturating_sub(FIXED_W)
        .max(10);
    let rows = state.visible();
    let page = body.height as usize;
    let first = state.scroll.min(rows.len().saturating_sub(page));

    frame.render_widget(Paragraph::new(header_line(state, header.width)), header);
    let paging = Paging {
        first,
        page,
        shown: rows.len(),
    };
    let status_text = status_lines(state, now, &paging, status.width, status.height as usize);
    frame.render_widget(Paragraph::new(status_text), status);
    frame.render_widget(Paragraph::new(queue), queue_area);
    frame.render_widget(Paragraph::new(title_line(state, id_w)), titles);
    let lines: Vec<Line> = if let Some(whole) = whole_error(state, body.width, page) {
        whole
    } else if rows.is_empty() {
        vec![Line::styled(
            match (state.updated, state.rows().is_empty()) {
                (None, _) => " waiting for the first answer from the admin listener",
                (Some(_), true) => " the fleet has no ranks",
                (Some(_), false) => " no rank matches the filter",
            },
            Style::new().fg(Color::DarkGray),
        )]
    } else {
        // Reasons wrap onto lines of their own when every row still fits; a fleet longer than
        // the screen gets one line per rank, reasons cut.
        let width = body.width as usize;
        let lines = |wrap: bool| -> Vec<Line<'static>> {
            (rows.iter().skip(first).take(page))
                .flat_map(|r| row_lines(r, id_w, width, wrap, state.stale()))
                .collect()
        };
        let wrapped = lines(true);
        if wrapped.len() <= page {
            wrapped
        } else {
            lines(false)
        }
    };
    frame.render_widget(Paragraph::new(lines), body);
    draw_keys(frame, state, keys);
}

/// With no rows to show and the admin listener failing, the error in full, wrapped over the
/// body (the status line has room for part of it only): a mistake such as a CA served as the
/// server's certificate is read there with its advice, never cut.
fn whole_error(state: &State, width: u16, page: usize) -> Option<Vec<Line<'static>>> {
    let o = state.outage.as_ref().filter(|_| state.rows().is_empty())?;
    let width = (width as usize).saturating_sub(2);
    let error = format!("admin unreachable: {}", o.error);
    let lines = wrap_words(&error, width, width, page.max(1));
    Some(
        (lines.into_iter())
            .map(|l| Line::styled(format!(" {l}"), Style::new().fg(Color::Red)))
            .collect(),
    )
}

/// Fleet totals, then the admin URL in what is left.
fn header_line(state: &State, width: u16) -> Line<'static> {
    let t = state.totals();
    let kv = t
        .mean_kv
        .map_or("-".into(), |k| format!("{:.0}%", k * 100.0));
    let rps = t.req_per_s.map_or("-".into(), fmt_rate);
    let totals = format!(
        " ranks {}/{} · kv {kv} · in-flight {} · req/s {rps} · ",
        t.available, t.total, t.in_flight
    );
    let room = (width as usize).saturating_sub(totals.chars().count());
    let style = Style::new().add_modifier(Modifier::REVERSED);
    let mut line = Line::from(vec![
        Span::styled(totals, style),
        Span::styled(
            truncate(&state.admin, room),
            style.add_modifier(Modifier::BOLD),
        ),
    ]);
    line = line.style(style);
    line
}

/// Column titles; the sort column's is marked.
fn title_line(state: &State, id_w: usize) -> Line<'static> {
    let arrow = if state.reversed { "▲" } else { "▼" };
    let mark = |key: SortKey, title: &str| {
        if state.sort == key {
            format!("{title}{arrow}")
        } else {
            title.to_string()
        }
    };
    let rank = mark(SortKey::Id, "RANK");
    let rank = match state.rows().iter().any(|r| r.role_mark().is_some()) {
        true => format!("{}P/D", pad(&rank, id_w.saturating_sub(3))),
        false => pad(&rank, id_w),
    };
    let text = [
        rank,
        pad(&mark(SortKey::State, "STATE"), STATE_W),
        pad("FAIL", FAIL_W),
        lpad(&mark(SortKey::InFlight, "INFL"), INFL_W),
        lpad(&mark(SortKey::ReqPerSec, "REQ/S"), REQS_W),
        pad(&mark(SortKey::Kv, "KV"), KV_W),
        lpad("RUN", RUN_W),
        lpad("WAIT", WAIT_W),
        pad("SRC", SRC_W),
        lpad("AGE", AGE_W),
    ]
    .join(" ");
    Line::styled(
        text,
        Style::new().add_modifier(Modifier::BOLD | Modifier::UNDERLINED),
    )
}

/// The rank's id, and at the column's end `P` for a prefill rank or `D` for a decode rank, so
/// the two sides of a disaggregated fleet are told apart (whole engines' ranks have no mark,
/// and a fleet of them looks as it always did).
fn rank_cell(r: &Row, id_w: usize) -> String {
    match r.role_mark() {
        Some(mark) => {
            let w = id_w.saturating_sub(2);
            format!("{} {mark}", pad(&short_id(&r.id, w), w))
        }
        None => pad(&short_id(&r.id, id_w), id_w),
    }
}

/// A rank's line, and when `wrap` is set the rest of its reason on up to two more lines, under
/// the STATE column.
fn row_lines(r: &Row, id_w: usize, width: usize, wrap: bool, stale: bool) -> Vec<Line<'static>> {
    let down = Style::new().fg(Color::Red);
    let num = |v: Option<u64>, w: usize| lpad(&v.map_or("-".into(), |n| n.to_string()), w);
    let mut spans = vec![
        Span::raw(rank_cell(r, id_w)),
        Span::raw(" "),
        Span::styled(
            pad(r.state(), STATE_W),
            if r.available() {
                Style::new().fg(Color::Green)
            } else {
                down.add_modifier(Modifier::BOLD)
            },
        ),
        Span::raw(" "),
        match r.fail_cell() {
            Some(fail) => Span::styled(pad(&truncate(&fail, FAIL_W), FAIL_W), down),
            None => Span::raw(pad("-", FAIL_W)),
        },
        Span::raw(" "),
        Span::raw(num(Some(r.in_flight), INFL_W)),
        Span::raw(" "),
        Span::raw(lpad(&r.req_per_s.map_or("-".into(), fmt_rate), REQS_W)),
        Span::raw(" "),
    ];
    let mut more = Vec::new();
    if r.available() {
        spans.extend(kv_bar(r.kv_usage));
        spans.extend([
            Span::raw(" "),
            Span::raw(num(r.num_running_reqs, RUN_W)),
            Span::raw(" "),
            Span::raw(num(r.num_waiting_reqs, WAIT_W)),
            Span::raw(" "),
            Span::raw(pad(&short_source(r.source.as_deref()), SRC_W)),
            Span::raw(" "),
            Span::raw(lpad(&r.age_ms.map_or("-".into(), fmt_age), AGE_W)),
        ]);
    } else {
        let reason = r.reason.as_deref().unwrap_or("telemetry unavailable");
        let indent = id_w + 1;
        let lines = if wrap {
            wrap_words(reason, REASON_W, width.saturating_sub(indent), REASON_LINES)
        } else {
            vec![truncate(reason, REASON_W)]
        };
        let mut lines = lines.into_iter();
        spans.push(Span::styled(
            pad(&lines.next().unwrap_or_default(), REASON_W),
            down,
        ));
        more.extend(
            lines.map(|l| Line::from(vec![Span::raw(" ".repeat(indent)), Span::styled(l, down)])),
        );
    }
    let mut out = vec![Line::from(spans)];
    out.extend(more);
    if stale {
        for line in &mut out {
            *line = std::mem::take(line).style(Style::new().add_modifier(Modifier::DIM));
        }
    }
    out
}

/// `text` in lines of `first` then `rest` characters, broken between words (a word longer
/// than a line is split), at most `max_lines` of them, the last ending in `…` if cut.
pub(super) fn wrap_words(text: &str, first: usize, rest: usize, max_lines: usize) -> Vec<String> {
    let width_of = |i: usize| if i == 0 { first } else { rest }.max(1);
    let mut lines = vec![String::new()];
    let mut cut = false;
    'words: for word in text.split_whitespace() {
        let mut word: Vec<char> = word.chars().collect();
        // Each turn places the word, places a piece of it, or opens a line (at most
        // `max_lines`), so it ends.
        loop {
            let i = lines.len() - 1;
            let w = width_of(i);
            let len = lines[i].chars().count();
            let sep = usize::from(len > 0);
            if len + sep + word.len() <= w {
                if sep == 1 {
                    lines[i].push(' ');
                }
                lines[i].extend(&word);
                continue 'words;
            }
            if len == 0 {
                lines[i].extend(&word[..w]);
                word.drain(..w);
                if word.is_empty() {
                    continue 'words;
                }
            }
            if lines.len() >= max_lines {
                cut = true;
                break 'words;
            }
            lines.push(String::new());
        }
    }
    if cut {
        let w = width_of(lines.len() - 1);
        if let Some(last) = lines.last_mut() {
            if last.chars().count() >= w {
                last.pop();
            }
            last.push('…');
        }
    }
    lines
}

/// The KV bar in eighths of a cell, then the percentage; green, yellow past 70 %, red past 90 %.
fn kv_bar(kv: Option<f64>) -> [Span<'static>; 2] {
    const EIGHTHS: [&str; 8] = ["", "▏", "▎", "▍", "▌", "▋", "▊", "▉"];
    let Some(kv) = kv.filter(|k| k.is_finite()) else {
        return [Span::raw(" ".repeat(BAR_W)), Span::raw(lpad("-", 5))];
    };
    let eighths = (kv.clamp(0.0, 1.0) * (BAR_W * 8) as f64).round() as usize;
    let (full, part) = (eighths / 8, eighths % 8);
    let mut bar = "█".repeat(full);
    bar.push_str(EIGHTHS[part]);
    let used = full + usize::from(part > 0);
    let color = if kv >= 0.9 {
        Color::Red
    } else if kv >= 0.7 {
        Color::Yellow
    } else {
        Color::Green
    };
    bar.push_str(&"░".repeat(BAR_W.saturating_sub(used)));
    [
        Span::styled(bar, Style::new().fg(color)),
        Span::raw(lpad(&format!("{:.0}%", kv * 100.0), 5)),
    ]
}

/// The key help, or the filter being typed (with the cursor after it).
fn draw_keys(frame: &mut Frame, state: &State, area: Rect) {
    let dim = Style::new().fg(Color::DarkGray);
    let key = Style::new().add_modifier(Modifier::BOLD);
    let line = match &state.editing {
        Some(text) => {
            let prompt = " filter (engine or model): ";
            let x = area.x + (prompt.chars().count() + text.chars().count()) as u16;
            if x < area.x + area.width {
                frame.set_cursor_position(Position::new(x, area.y));
            }
            Line::from(vec![
                Span::styled(prompt, key),
                Span::raw(text.clone()),
                Span::styled("   Enter apply · Esc cancel", dim),
            ])
        }
        None => {
            let mut spans = vec![Span::raw(" ")];
            for (k, what) in [
                ("q", "quit"),
                ("s", "sort"),
                ("r", "reverse"),
                ("/", "filter"),
                ("↑↓", "scroll"),
            ] {
                spans.push(Span::styled(k, key));
                spans.push(Span::styled(format!(" {what}  "), dim));
            }
            spans.push(Span::styled("rankgate top", dim));
            Line::from(spans)
        }
    };
    frame.render_widget(Paragraph::new(line), area);
}

fn short_source(s: Option<&str>) -> String {
    match s {
        Some("prometheus") => "prom".into(),
        Some(s) => truncate(s, SRC_W),
        None => "-".into(),
    }
}

/// A rate in at most 6 characters.
pub(super) fn fmt_rate(r: f64) -> String {
    if r < 100.0 {
        format!("{r:.1}")
    } else {
        format!("{r:.0}")
    }
}

/// An age in at most 5 characters: `850ms`, `3.2s`, `42s`, `12m`, `5h`, `12d`.
pub(super) fn fmt_age(ms: u64) -> String {
    match ms {
        0..=999 => format!("{ms}ms"),
        1_000..=9_999 => format!("{:.1}s", ms as f64 / 1000.0),
        10_000..=99_999 => format!("{}s", ms / 1000),
        100_000..=5_999_999 => format!("{}m", ms / 60_000),
        6_000_000..=359_999_999 => format!("{}h", ms / 3_600_000),
        _ => format!("{}d", (ms / 86_400_000).min(9_999)),
    }
}

/// `s` cut or padded to exactly `w` characters, left-aligned.
fn pad(s: &str, w: usize) -> String {
    format!("{:<w$}", truncate(s, w))
}

/// `s` cut or padded to exactly `w` characters, right-aligned.
fn lpad(s: &str, w: usize) -> String {
    format!("{:>w$}", truncate(s, w))
}

#[cfg(test)]
mod tests;
