//! The status area under the header: one line of sort, filter, paging and interval, or (in
//! red) why the rows are stale; and under it, wrapped between words, any error that line cannot
//! hold, so that a long one (a CA served as the server's certificate, with rustls' variant
//! names) is read whole rather than cut at the terminal's edge.
//!
//! The wrapped lines come out of the rank rows' space, at most half of it: the rows stay in view.
//! With no rows at all, the admin's error is wrapped over the body instead (`view`), so it is
//! not told twice.

use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use tokio::time::Instant;

use super::model::{truncate, State};
use super::view::{fmt_age, rows_on_screen, wrap_words};

/// Which rows are on screen: the first shown, how many fit, how many pass the filter.
pub struct Paging {
    pub first: usize,
    pub page: usize,
    pub shown: usize,
}

/// Lines the status area takes on a `width` x `height` terminal: the status line, and the
/// wrapped errors under it.
pub fn status_height(state: &State, now: Instant, width: u16, height: u16) -> u16 {
    let page = rows_on_screen(height);
    let shown = state.visible().len();
    let paging = Paging {
        first: state.scroll.min(shown.saturating_sub(page)),
        page,
        shown,
    };
    let most = 1 + page / 2;
    status_lines(state, now, &paging, width, most).len().max(1) as u16
}

/// The status line, then the errors it could not hold, wrapped; at most `max_lines` in all.
pub fn status_lines(
    state: &State,
    now: Instant,
    paging: &Paging,
    width: u16,
    max_lines: usize,
) -> Vec<Line<'static>> {
    let width = width as usize;
    let (line, below) = status_line(state, now, paging, width);
    let mut lines = vec![line];
    let room = max_lines.saturating_sub(1);
    if let (Some((text, style)), true) = (below, room > 0) {
        // One column of margin each side, as the body's lines have.
        let w = width.saturating_sub(2);
        lines.extend(
            (wrap_words(&text, w, w, room).into_iter())
                .map(|l| Line::styled(format!(" {l}"), style)),
        );
    }
    lines
}

/// Sort and filter, or (in red) why the rows are stale; and the error it could not hold, to be
/// wrapped below, with its colour.
fn status_line(
    state: &State,
    now: Instant,
    paging: &Paging,
    width: usize,
) -> (Line<'static>, Option<(String, Style)>) {
    if let Some(o) = &state.outage {
        let age = match state.updated {
            Some(at) => format!(
                "stale {}",
                fmt_age(now.saturating_duration_since(at).as_millis() as u64)
            ),
            None => "no data yet".into(),
        };
        let tail = format!(" · {age} · {} failed", o.failures);
        let head = " admin unreachable: ";
        let fits = (head.chars().count() + o.error.chars().count() + tail.chars().count()) <= width;
        let red = Style::new()
            .fg(Color::White)
            .bg(Color::Red)
            .add_modifier(Modifier::BOLD);
        // Too long for the line: the line says so and keeps how old the rows are in view; the
        // error follows whole, below (or over the body when there are no rows).
        let (text, below) = match fits {
            true => (format!("{head}{}{tail}", o.error), None),
            false => {
                let below = (!state.rows().is_empty()).then(|| {
                    let msg = format!("admin unreachable: {}", o.error);
                    (msg, Style::new().fg(Color::Red))
                });
                (format!(" admin unreachable (the error below){tail}"), below)
            }
        };
        return (Line::styled(truncate(&text, width), red), below);
    }
    let arrow = if state.reversed { "▲" } else { "▼" };
    let mut text = format!(" sort {} {arrow}", state.sort);
    if !state.filter.is_empty() {
        text.push_str(&format!(" · filter \"{}\"", state.filter));
    }
    let total = state.rows().len();
    let Paging { first, page, shown } = *paging;
    if shown > page {
        text.push_str(&format!(
            " · rows {}-{} of {shown}",
            first + 1,
            (first + page).min(shown)
        ));
    } else if shown != total {
        text.push_str(&format!(" · {shown} of {total} ranks"));
    }
    text.push_str(&format!(" · every {}", fmt_interval(state)));
    let mut spans = vec![Span::raw(truncate(&text, width))];
    // An engine the config describes wrongly (its DP size, say) is routed as it reports itself;
    // the operator should still hear of it.
    let mut notes: Vec<(&str, &str)> = (state.rows().iter())
        .filter_map(|r| Some((r.engine.as_str(), r.engine_note.as_deref()?)))
        .collect();
    notes.dedup_by_key(|(engine, _)| *engine);
    let mut used = text.chars().count();
    if let Some((engine, note)) = notes.first() {
        let room = width.saturating_sub(used);
        let note = truncate(
            &format!(" · {} config ≠ engine: {engine}: {note}", notes.len()),
            room,
        );
        used += note.chars().count();
        spans.push(Span::styled(note, Style::new().fg(Color::Yellow)));
    }
    let mut below = None;
    if let Some(e) = &state.metrics_error {
        let yellow = Style::new().fg(Color::Yellow);
        let room = width.saturating_sub(used);
        let whole = format!(" · /metrics: {e}");
        let said = match whole.chars().count() <= room {
            true => whole,
            false => {
                below = Some((format!("/metrics: {e}"), yellow));
                truncate(" · /metrics failed (below)", room)
            }
        };
        spans.push(Span::styled(said, yellow));
    }
    (Line::from(spans), below)
}

fn fmt_interval(state: &State) -> String {
    let ms = state.interval.as_millis();
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(line: &Line) -> String {
        line.spans.iter().map(|s| s.content.to_string()).collect()
    }

    fn paging() -> Paging {
        Paging {
            first: 0,
            page: 10,
            shown: 3,
        }
    }

    #[test]
    fn an_engine_the_config_describes_wrongly_is_named_in_the_status_line() {
        let mut state = State::new("http://127.0.0.1:9090", std::time::Duration::from_secs(1));
        let workers = r#"[
            {"id":"http://a:1@0","engine":"http://a:1","telemetry":"available","in_flight":0,
             "engine_note":"configured dp_size 4, the engine reports 2 ranks"},
            {"id":"http://a:1@1","engine":"http://a:1","telemetry":"available","in_flight":0,
             "engine_note":"configured dp_size 4, the engine reports 2 ranks"},
            {"id":"http://b:1","engine":"http://b:1","telemetry":"unavailable",
             "reason":"flavor and DP size not known yet: ...","reason_kind":"shape_unknown"}]"#;
        state
            .apply(Instant::now(), workers.as_bytes(), Ok(""))
            .unwrap();
        let (line, below) = status_line(&state, Instant::now(), &paging(), 200);
        let text = text(&line);
        assert!(below.is_none());
        assert!(
            text.contains("1 config ≠ engine: http://a:1: configured dp_size 4"),
            "{text}"
        );
        assert_eq!(state.rows()[2].state(), "unknown");
    }

    #[test]
    fn a_metrics_error_too_long_for_the_line_is_wrapped_whole_below_it() {
        let mut state = State::new("http://127.0.0.1:9090", std::time::Duration::from_secs(1));
        let error = format!("HTTP 500: {}", "the reason the metrics failed ".repeat(6));
        let rows = r#"[{"id":"http://a:1@0","engine":"http://a:1","telemetry":"available"}]"#;
        state
            .apply(Instant::now(), rows.as_bytes(), Err(error.clone()))
            .unwrap();
        let lines = status_lines(&state, Instant::now(), &paging(), 80, 10);
        assert!(
            text(&lines[0]).contains("/metrics failed (below)"),
            "{lines:?}"
        );
        let rest: Vec<String> = lines[1..]
            .iter()
            .map(|l| text(l).trim().to_string())
            .collect();
        assert_eq!(rest.join(" "), format!("/metrics: {}", error.trim_end()));
        assert!(lines.iter().all(|l| text(l).chars().count() <= 80));
        // Room for one line only: the status line alone.
        assert_eq!(
            status_lines(&state, Instant::now(), &paging(), 80, 1).len(),
            1
        );
    }
}
