//! The queue line under the status line, when the router runs flow control: each objective,
//! highest priority first, with the requests waiting in the router now and, over the last
//! interval, the mean wait of those that left the queue, the 503s per second (and their main
//! reason) and the clients that gave up waiting:
//!
//! ` queue: premium 0 · default 3 (wait 1.2s, refused 0.5/s deadline) · batch 12`
//!
//! Objectives are packed whole onto as many lines as they need, at most [`max_lines`]; those
//! that do not fit are counted (`+5 more`). With flow control off there is no line at all.

use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};

use super::flow::Objective;
use super::model::{truncate, State};
use super::view::{fmt_age, fmt_rate, rows_on_screen};

const PREFIX: &str = " queue: ";
const SEP: &str = " · ";

/// Most queue lines on a terminal `height` lines high: an eighth of the rows' room, so the
/// ranks stay in view.
pub fn max_lines(height: u16) -> usize {
    (rows_on_screen(height) / 8).max(1)
}

/// The queue's lines at `width` columns, at most `max_lines`; none when flow control is off.
pub fn queue_lines(state: &State, width: u16, max_lines: usize) -> Vec<Line<'static>> {
    let Some(queue) = state.queue() else {
        return Vec::new();
    };
    let indent = PREFIX.chars().count();
    let room = (width as usize).saturating_sub(indent);
    let items: Vec<Vec<Span<'static>>> = queue.iter().map(|o| fit(item(o), room)).collect();
    let widths: Vec<usize> = items.iter().map(|i| spans_width(i)).collect();
    let (lines, left_out) = pack(&widths, room, max_lines.max(1));
    let dim = Style::new().fg(Color::DarkGray);
    let mut items = items.into_iter();
    let mut out = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let mut spans = vec![match n {
            0 => Span::styled(PREFIX, Style::new().add_modifier(Modifier::BOLD)),
            _ => Span::raw(" ".repeat(indent)),
        }];
        for (k, _) in line.iter().enumerate() {
            if k > 0 {
                spans.push(Span::styled(SEP, dim));
            }
            spans.extend(items.next().unwrap_or_default());
        }
        if n + 1 == lines.len() && left_out > 0 {
            let sep = if line.is_empty() { "" } else { SEP };
            spans.push(Span::styled(format!("{sep}{}", more(left_out)), dim));
        }
        out.push(Line::from(spans));
    }
    if state.stale() {
        for line in &mut out {
            *line = std::mem::take(line).style(Style::new().add_modifier(Modifier::DIM));
        }
    }
    out
}

/// One objective: its name and how many wait, then what the interval saw, if anything.
fn item(o: &Objective) -> Vec<Span<'static>> {
    let busy = Style::new().fg(Color::Yellow).add_modifier(Modifier::BOLD);
    let mut spans = vec![Span::styled(
        format!("{} {}", o.name, o.waiting),
        if o.waiting > 0 { busy } else { Style::new() },
    )];
    let mut extra: Vec<Span<'static>> = Vec::new();
    if let Some(w) = o.mean_wait {
        extra.push(Span::raw(format!("wait {}", fmt_age((w * 1000.0) as u64))));
    }
    if let Some(r) = o.refused_per_s.filter(|r| *r > 0.0) {
        let why = o
            .refused_mostly
            .as_deref()
            .map_or(String::new(), |w| format!(" {w}"));
        extra.push(Span::styled(
            format!("refused {}/s{why}", rate(r)),
            Style::new().fg(Color::Red),
        ));
    }
    if let Some(r) = o.left_per_s.filter(|r| *r > 0.0) {
        extra.push(Span::raw(format!("left {}/s", rate(r))));
    }
    for (i, e) in extra.into_iter().enumerate() {
        spans.push(Span::raw(if i == 0 { " (" } else { ", " }));
        spans.push(e);
    }
    if spans.len() > 1 {
        spans.push(Span::raw(")"));
    }
    spans
}

/// A rate that is not 0 never reads `0.0`: one refusal in a minute is 0.02/s.
fn rate(r: f64) -> String {
    if r < 0.1 {
        format!("{r:.2}")
    } else {
        fmt_rate(r)
    }
}

fn more(n: usize) -> String {
    format!("+{n} more")
}

fn spans_width(spans: &[Span]) -> usize {
    spans.iter().map(|s| s.content.chars().count()).sum()
}

/// An item wider than a whole line, cut to it in the style of its first part (its name).
fn fit(spans: Vec<Span<'static>>, room: usize) -> Vec<Span<'static>> {
    if spans_width(&spans) <= room {
        return spans;
    }
    let style = spans.first().map_or(Style::new(), |s| s.style);
    let text: String = spans.iter().map(|s| s.content.as_ref()).collect();
    vec![Span::styled(truncate(&text, room), style)]
}

/// Places items of `widths` onto lines of `room` columns, whole and in order, at most
/// `max_lines`: the item indices of each line, and how many did not fit (counted at the end of
/// the last line, which then gives up items until the count fits too).
fn pack(widths: &[usize], room: usize, max_lines: usize) -> (Vec<Vec<usize>>, usize) {
    let sep = SEP.chars().count();
    let line_w = |line: &[usize]| {
        line.iter().map(|i| widths[*i]).sum::<usize>() + sep * line.len().saturating_sub(1)
    };
    let mut lines: Vec<Vec<usize>> = vec![Vec::new()];
    let mut next = 0;
    while next < widths.len() {
        let last = lines.len() - 1;
        let used = line_w(&lines[last]);
        let gap = if lines[last].is_empty() { 0 } else { sep };
        if lines[last].is_empty() || used + gap + widths[next] <= room {
            lines[last].push(next);
            next += 1;
        } else if lines.len() < max_lines {
            lines.push(Vec::new());
        } else {
            break;
        }
    }
    let mut left_out = widths.len() - next;
    if left_out > 0 {
        let last = lines.len() - 1;
        loop {
            let line = &lines[last];
            let gap = if line.is_empty() { 0 } else { sep };
            let need = line_w(line) + gap + more(left_out).chars().count();
            if need <= room || line.is_empty() {
                break;
            }
            lines[last].pop();
            left_out += 1;
        }
    }
    (lines, left_out)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::*;

    fn text(line: &Line) -> String {
        line.spans.iter().map(|s| s.content.to_string()).collect()
    }

    fn objective(name: &str, waiting: u64) -> Objective {
        Objective {
            name: name.into(),
            waiting,
            refused_per_s: Some(0.0),
            refused_mostly: None,
            left_per_s: Some(0.0),
            mean_wait: None,
        }
    }

    /// A state whose `/metrics` had objectives premium, default and batch.
    fn state(metrics: &str) -> State {
        let mut s = State::new("http://127.0.0.1:9090", Duration::from_secs(1));
        let rows = r#"[{"id":"http://a:1@0","engine":"http://a:1","telemetry":"available"}]"#;
        s.apply(Instant::now(), rows.as_bytes(), Ok(metrics))
            .unwrap();
        s
    }

    #[test]
    fn each_objective_says_what_waits_and_what_the_interval_saw() {
        let busy = Objective {
            mean_wait: Some(1.234),
            refused_per_s: Some(0.5),
            refused_mostly: Some("deadline".into()),
            left_per_s: Some(0.02),
            ..objective("default", 3)
        };
        let got: String = item(&busy).iter().map(|s| s.content.to_string()).collect();
        assert_eq!(
            got,
            "default 3 (wait 1.2s, refused 0.5/s deadline, left 0.02/s)"
        );
        let got: String = (item(&objective("batch", 0)).iter())
            .map(|s| s.content.to_string())
            .collect();
        assert_eq!(got, "batch 0");
        // The first reading: what waits is known, no rate yet.
        let first = Objective {
            refused_per_s: None,
            left_per_s: None,
            ..objective("premium", 1)
        };
        assert_eq!(item(&first)[0].content, "premium 1");
        assert_eq!(item(&first).len(), 1);
    }

    #[test]
    fn objectives_are_packed_whole_and_those_left_out_counted() {
        // Everything on one line when it fits.
        assert_eq!(pack(&[5, 5, 5], 30, 2), (vec![vec![0, 1, 2]], 0));
        // Wrapped whole onto the next line.
        assert_eq!(pack(&[10, 10, 10], 25, 3), (vec![vec![0, 1], vec![2]], 0));
        // One line only: the rest counted, an item given up to make room for the count.
        let (lines, left) = pack(&[10, 10, 10, 10], 25, 1);
        assert_eq!((lines, left), (vec![vec![0]], 3));
        assert_eq!(pack(&[], 25, 1), (vec![vec![]], 0));
    }

    #[test]
    fn the_line_shows_with_flow_control_only_and_fits_the_width() {
        let off = state("rankgate_requests_total{worker=\"http://a:1@0\",status=\"200\"} 1\n");
        assert!(queue_lines(&off, 80, 3).is_empty());

        let mut metrics = String::new();
        for (name, n) in [("premium", 0), ("default", 3), ("batch", 12)] {
            metrics += &format!("rankgate_flow_queue_requests{{objective=\"{name}\"}} {n}\n");
        }
        let on = state(&metrics);
        let lines = queue_lines(&on, 80, 3);
        let lines: Vec<String> = lines.iter().map(text).collect();
        assert_eq!(lines, [" queue: premium 0 · default 3 · batch 12"]);

        // Many objectives on a narrow screen: whole ones per line, the rest counted.
        let mut metrics = String::new();
        for i in 0..40 {
            metrics += &format!("rankgate_flow_queue_requests{{objective=\"tier-{i}\"}} {i}\n");
        }
        let many = state(&metrics);
        let lines: Vec<String> = queue_lines(&many, 40, 2).iter().map(text).collect();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(
            lines[0].starts_with(" queue: tier-0 0 · tier-1 1"),
            "{lines:?}"
        );
        assert!(lines[1].starts_with("        tier-"), "{lines:?}");
        assert!(lines[1].ends_with(" more"), "{lines:?}");
        assert!(lines.iter().all(|l| l.chars().count() <= 40), "{lines:?}");
        // A name longer than the line is cut, not spilled.
        let long = format!(
            "rankgate_flow_queue_requests{{objective=\"{}\"}} 1\n",
            "x".repeat(100)
        );
        let lines: Vec<String> = queue_lines(&state(&long), 40, 2).iter().map(text).collect();
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0].chars().count(), 40, "{lines:?}");
        assert!(lines[0].ends_with('…'), "{lines:?}");
    }
}
