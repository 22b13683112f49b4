//! The router's flow-control queue as `rankgate top` knows it, from the `rankgate_flow_*` series
//! of `/metrics` (written only with `[flow] enabled = true`): per objective, the requests waiting
//! now, and over the last interval the refusals per second and the mean wait of those that left
//! the queue (the deltas of `rankgate_flow_wait_seconds`' `_sum` and `_count`).
//!
//! No flow series, no queue: a router with flow control off (or older than it) shows nothing
//! more. Kept pure, like [`super::rates`], so the parsing and the deltas are unit tests.

use std::collections::HashMap;

use tokio::time::Instant;

use super::rates::sample;

const QUEUED: &str = "rankgate_flow_queue_requests";
const REJECTED: &str = "rankgate_flow_rejected_total";
const WAIT_SUM: &str = "rankgate_flow_wait_seconds_sum";
const WAIT_COUNT: &str = "rankgate_flow_wait_seconds_count";
/// The rejection that is the client's doing, not the router's: it left while waiting. Told
/// apart from the 503s (a full queue, a deadline), which are what an operator acts on.
const CLIENT_GONE: &str = "client_gone";

/// One objective's series in one reading of `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counts {
    pub name: String,
    pub queued: f64,
    /// `rankgate_flow_rejected_total` by reason.
    pub rejected: HashMap<String, f64>,
    pub wait_sum: f64,
    pub wait_count: f64,
}

/// Every objective's series in one reading, in the order `/metrics` lists them (the router's:
/// highest priority first).
pub type Reading = Vec<Counts>;

/// The flow series of a `/metrics` text; `None` when it has none (flow control is off).
pub fn reading(metrics: &str) -> Option<Reading> {
    let mut objectives: Reading = Vec::new();
    let mut present = false;
    for line in metrics.lines() {
        if !line.starts_with("rankgate_flow_") {
            continue;
        }
        let Some((name, labels, value)) = sample(line) else {
            continue;
        };
        if !value.is_finite() || ![QUEUED, REJECTED, WAIT_SUM, WAIT_COUNT].contains(&name) {
            continue;
        }
        let label = |key: &str| labels.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        let Some(objective) = label("objective") else {
            continue;
        };
        present = true;
        let i = match objectives.iter().position(|o| &o.name == objective) {
            Some(i) => i,
            None => {
                objectives.push(Counts {
                    name: objective.clone(),
                    ..Counts::default()
                });
                objectives.len() - 1
            }
        };
        let o = &mut objectives[i];
        match name {
            QUEUED => o.queued = value,
            WAIT_SUM => o.wait_sum = value,
            WAIT_COUNT => o.wait_count = value,
            _ => {
                if let Some(reason) = label("reason") {
                    *o.rejected.entry(reason.clone()).or_insert(0.0) += value;
                }
            }
        }
    }
    present.then_some(objectives)
}

/// One objective's line on screen.
#[derive(Debug, Clone, PartialEq)]
pub struct Objective {
    pub name: String,
    /// Requests waiting in the router now.
    pub waiting: u64,
    /// Requests answered 503 per second (every reason but the client's leaving); `None` until
    /// two readings were seen.
    pub refused_per_s: Option<f64>,
    /// The reason most of them had, when any were refused.
    pub refused_mostly: Option<String>,
    /// Clients that went away while waiting, per second; `None` as `refused_per_s`.
    pub left_per_s: Option<f64>,
    /// The mean wait, in seconds, of the requests that left the queue over the interval;
    /// `None` when none did (or no second reading yet).
    pub mean_wait: Option<f64>,
}

/// The queue from successive readings: the latest gauges and the counters' deltas.
#[derive(Debug, Default)]
pub struct Queue {
    last: Option<(Instant, Reading)>,
}

impl Queue {
    /// Records a reading taken at `at` (`None`: the text had no flow series) and returns each
    /// objective's line; `None` when flow control is off. A counter that went down was reset (a
    /// restarted router answers at the same address), so it counts from zero.
    pub fn update(&mut self, at: Instant, reading: Option<Reading>) -> Option<Vec<Objective>> {
        let Some(now) = reading else {
            self.last = None;
            return None;
        };
        let secs = (self.last.as_ref()).map(|(then, _)| at.saturating_duration_since(*then));
        let secs = secs.map(|d| d.as_secs_f64()).filter(|s| *s > 0.0);
        let lines = (now.iter())
            .map(|o| {
                let before = (self.last.as_ref())
                    .and_then(|(_, prev)| prev.iter().find(|p| p.name == o.name));
                line(o, before, secs)
            })
            .collect();
        self.last = Some((at, now));
        Some(lines)
    }

    /// Forgets the last reading (`/metrics` failed): the next one starts afresh.
    pub fn reset(&mut self) {
        self.last = None;
    }
}

/// `o`'s line; rates only with a previous reading (`before`, absent for an objective new since
/// it: counted from zero) taken `secs` earlier.
fn line(o: &Counts, before: Option<&Counts>, secs: Option<f64>) -> Objective {
    let delta = |now: f64, then: f64| if now >= then { now - then } else { now };
    let zero = Counts::default();
    let before = before.unwrap_or(&zero);
    let mut refused = 0.0;
    let mut left = 0.0;
    let mut mostly: Option<(&str, f64)> = None;
    for (reason, n) in &o.rejected {
        let d = delta(*n, before.rejected.get(reason).copied().unwrap_or(0.0));
        if reason == CLIENT_GONE {
            left += d;
            continue;
        }
        refused += d;
        // Ties go to the name first in order, so the word does not flicker between polls.
        let more = mostly.is_none_or(|(r, m)| d > m || (d == m && reason.as_str() < r));
        if d > 0.0 && more {
            mostly = Some((reason, d));
        }
    }
    // A reset shows as a count gone down: then both are counted from zero.
    let (sum, count) = match o.wait_count >= before.wait_count {
        true => (
            o.wait_sum - before.wait_sum,
            o.wait_count - before.wait_count,
        ),
        false => (o.wait_sum, o.wait_count),
    };
    Objective {
        name: o.name.clone(),
        waiting: o.queued.max(0.0) as u64,
        refused_per_s: secs.map(|s| refused / s),
        refused_mostly: secs.and(mostly).map(|(r, _)| r.to_string()),
        left_per_s: secs.map(|s| left / s),
        mean_wait: secs.filter(|_| count > 0.0).map(|_| (sum / count).max(0.0)),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// `/metrics` as the router writes it with objectives premium and default.
    fn text(queued: u64, deadline: u64, full: u64, gone: u64, sum: f64, count: u64) -> String {
        let mut t = String::from(
            "# HELP rankgate_flow_queue_requests Requests waiting\n\
             # TYPE rankgate_flow_queue_requests gauge\n\
             rankgate_flow_queue_requests{objective=\"premium\"} 0\n",
        );
        t += &format!("rankgate_flow_queue_requests{{objective=\"default\"}} {queued}\n");
        for (o, how) in [("premium", "direct"), ("default", "queued")] {
            t += &format!("rankgate_flow_dispatched_total{{objective=\"{o}\",how=\"{how}\"}} 9\n");
        }
        for (reason, n) in [
            ("queue_full", full),
            ("tenant_queue_full", 0),
            ("deadline", deadline),
            ("shutting_down", 0),
            ("client_gone", gone),
        ] {
            t += &format!(
                "rankgate_flow_rejected_total{{objective=\"default\",reason=\"{reason}\"}} {n}\n"
            );
        }
        t += "rankgate_flow_wait_seconds_bucket{le=\"0.5\",objective=\"default\"} 1\n";
        t += &format!("rankgate_flow_wait_seconds_sum{{objective=\"default\"}} {sum}\n");
        t += &format!("rankgate_flow_wait_seconds_count{{objective=\"default\"}} {count}\n");
        t += "rankgate_flow_wait_seconds_sum{objective=\"premium\"} 0.0\n\
              rankgate_flow_wait_seconds_count{objective=\"premium\"} 0\n\
              rankgate_flow_tenants 3\n\
              rankgate_flow_tenant_tokens_total{tenant=\"~other\"} 12\n";
        t
    }

    #[test]
    fn the_series_are_read_by_objective_in_their_order() {
        let r = reading(&text(3, 2, 1, 4, 1.5, 3)).expect("flow series");
        let names: Vec<&str> = r.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["premium", "default"]);
        let d = &r[1];
        assert_eq!(d.queued, 3.0);
        assert_eq!(d.rejected["deadline"], 2.0);
        assert_eq!(d.rejected["client_gone"], 4.0);
        assert_eq!((d.wait_sum, d.wait_count), (1.5, 3.0));
        // Flow control off: other series only, no queue.
        let off = "# TYPE rankgate_requests_total counter\n\
                   rankgate_requests_total{worker=\"http://a:1@0\",status=\"200\"} 4\n";
        assert_eq!(reading(off), None);
        // A line that does not parse costs its own figure only.
        let odd = "rankgate_flow_queue_requests{objective=\"x\"} NaN\n\
                   rankgate_flow_queue_requests{objective=\"broken} 1\n\
                   rankgate_flow_queue_requests{objective=\"y\"} 2 1700000000\n";
        let r = reading(odd).expect("one good line");
        assert_eq!((r.len(), r[0].name.as_str(), r[0].queued), (1, "y", 2.0));
    }

    #[test]
    fn rates_and_the_mean_wait_come_from_the_deltas() {
        let t0 = Instant::now();
        let mut q = Queue::default();
        let first = q.update(t0, reading(&text(3, 2, 1, 4, 1.5, 3))).unwrap();
        // One reading: what waits is known, no rate is.
        assert_eq!(first[1].waiting, 3);
        assert_eq!(first[1].refused_per_s, None);
        assert_eq!(first[1].mean_wait, None);
        let later = t0 + Duration::from_secs(2);
        let second = q.update(later, reading(&text(1, 6, 2, 6, 4.5, 5))).unwrap();
        let d = &second[1];
        assert_eq!(d.waiting, 1);
        // 4 deadlines and 1 full queue in 2 s; the 2 clients gone apart.
        assert_eq!(d.refused_per_s, Some(2.5));
        assert_eq!(d.refused_mostly.as_deref(), Some("deadline"));
        assert_eq!(d.left_per_s, Some(1.0));
        // 3 s waited by 2 requests.
        assert_eq!(d.mean_wait, Some(1.5));
        // Premium: idle, so 0 refused and no wait to tell of.
        let p = &second[0];
        assert_eq!(
            (p.refused_per_s, p.refused_mostly.clone()),
            (Some(0.0), None)
        );
        assert_eq!(p.mean_wait, None);
        // No time passed: no rate rather than a division by zero.
        let same = q.update(later, reading(&text(1, 6, 2, 6, 4.5, 5))).unwrap();
        assert_eq!((same[1].refused_per_s, same[1].mean_wait), (None, None));
        // A restarted router: counters went down, so they count from zero.
        let t = |s| later + Duration::from_secs(s);
        let third = q.update(t(1), reading(&text(0, 1, 0, 0, 0.5, 1))).unwrap();
        assert_eq!(third[1].refused_per_s, Some(1.0));
        assert_eq!(third[1].mean_wait, Some(0.5));
        let fourth = q.update(t(2), reading(&text(0, 1, 0, 0, 0.5, 1))).unwrap();
        assert_eq!(fourth[1].mean_wait, None, "no wait ended in the interval");
        assert_eq!(fourth[1].refused_per_s, Some(0.0));
        // Flow control turned off: nothing, and the next reading starts afresh.
        assert_eq!(q.update(t(3), None), None);
        let again = q.update(t(4), reading(&text(2, 9, 9, 9, 9.0, 9))).unwrap();
        assert_eq!(again[1].refused_per_s, None);
    }
}
