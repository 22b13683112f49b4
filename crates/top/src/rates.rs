//! Requests per second per worker, from the deltas of `rankgate_requests_total` (and of each
//! prefill rank's `rankgate_pd_legs_total`) between two readings of the admin's `/metrics`.
//! Before a second reading no rate is known (`-` on screen); after it every worker has one, a
//! worker with no series included (0: rankgate writes a worker's series from its first answer
//! on), so a rank idle since the router started and a rank that went idle read the same.

use std::collections::HashMap;

use tokio::time::Instant;

/// The counter whose per-worker deltas are requests per second.
const REQUESTS_TOTAL: &str = "rankgate_requests_total";
/// Legs of disaggregated requests by rank: a prefill rank answers no client request (the decode
/// leg's answer is the client's, counted on the decode rank), so its load is its prefill legs.
const PD_LEGS_TOTAL: &str = "rankgate_pd_legs_total";

/// One reading's rates, by worker.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PerWorker(pub HashMap<String, f64>);

impl PerWorker {
    /// `worker`'s rate. A worker with no series has answered no request since the router
    /// started (rankgate writes a worker's series from its first answer on): 0, as true as a
    /// series that did not move, not "unknown".
    pub fn of(&self, worker: &str) -> f64 {
        self.0.get(worker).copied().unwrap_or(0.0)
    }
}

/// Requests per second per worker, from two readings of a monotonic counter.
#[derive(Debug, Default)]
pub struct Rates {
    last: Option<(Instant, HashMap<String, f64>)>,
}

impl Rates {
    /// Records a reading taken at `at` and returns each worker's rate since the previous one;
    /// `None` for the first reading (or one taken no time after it): no rate is known yet.
    /// A worker new since the previous reading counts from zero (it joined in between); a
    /// counter that went down was reset (the engine was removed and added again), so it too
    /// counts from zero, as Prometheus' `rate()` does.
    pub fn update(&mut self, at: Instant, counts: HashMap<String, f64>) -> Option<PerWorker> {
        let mut rates = None;
        if let Some((then, prev)) = &self.last {
            let secs = at.saturating_duration_since(*then).as_secs_f64();
            if secs > 0.0 {
                let mut per = HashMap::new();
                for (worker, now) in &counts {
                    let before = prev.get(worker).copied().unwrap_or(0.0);
                    let delta = if *now >= before { now - before } else { *now };
                    per.insert(worker.clone(), delta / secs);
                }
                rates = Some(PerWorker(per));
            }
        }
        self.last = Some((at, counts));
        rates
    }

    /// Forgets the last reading: the next one starts afresh (after `/metrics` failed once, a
    /// delta across the gap would still be right, but only if the same router answered).
    pub fn reset(&mut self) {
        self.last = None;
    }
}

/// Sums `rankgate_requests_total` by its `worker` label over every other label (status code
/// today; model, route or code should they be added), plus each rank's prefill legs
/// (`rankgate_pd_legs_total{leg="prefill"}`), from Prometheus text exposition: every request
/// counts on the rank that served it, each leg of a disaggregated one on its own rank.
pub fn request_counts(metrics: &str) -> HashMap<String, f64> {
    let mut counts = HashMap::new();
    for line in metrics.lines() {
        let (rest, legs) = match line.strip_prefix(REQUESTS_TOTAL) {
            Some(rest) => (rest, false),
            None => match line.strip_prefix(PD_LEGS_TOTAL) {
                Some(rest) => (rest, true),
                None => continue,
            },
        };
        let Some(labels) = rest.strip_prefix('{') else {
            continue;
        };
        let Some((labels, value)) = split_labels(labels) else {
            continue;
        };
        // Decode legs are in rankgate_requests_total already (their answer is the client's).
        if legs && !labels.iter().any(|(k, v)| k == "leg" && v == "prefill") {
            continue;
        }
        let Some(worker) = labels
            .into_iter()
            .find_map(|(k, v)| (k == "worker").then_some(v))
        else {
            continue;
        };
        // The sample value, then an optional timestamp.
        let Some(Ok(value)) = value.split_whitespace().next().map(str::parse::<f64>) else {
            continue;
        };
        if value.is_finite() {
            *counts.entry(worker).or_insert(0.0) += value;
        }
    }
    counts
}

/// A sample's labels: names and (unescaped) values.
pub(crate) type Labels = Vec<(String, String)>;

/// One sample of Prometheus text exposition: its metric name, labels (values unescaped) and
/// value; `None` for a comment, a blank line or one that does not parse (read leniently: one
/// odd line costs its own figure only).
pub(crate) fn sample(line: &str) -> Option<(&str, Labels, f64)> {
    let end = line.find(['{', ' '])?;
    let (name, rest) = line.split_at(end);
    if name.is_empty() || name.starts_with('#') {
        return None;
    }
    let (labels, value) = match rest.strip_prefix('{') {
        Some(labels) => split_labels(labels)?,
        None => (Vec::new(), rest),
    };
    // The value, then an optional timestamp.
    let value = value.split_whitespace().next()?.parse::<f64>().ok()?;
    Some((name, labels, value))
}

/// Splits `name="value",...}rest` into its labels (values unescaped) and what follows the `}`.
fn split_labels(s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    let mut chars = s.char_indices().peekable();
    loop {
        // Skip separators; `}` ends the set.
        while let Some((_, c)) = chars.peek() {
            if *c == ',' || c.is_whitespace() {
                chars.next();
            } else {
                break;
            }
        }
        let (start, c) = chars.next()?;
        if c == '}' {
            return Some((labels, &s[start + 1..]));
        }
        let mut name = String::from(c);
        loop {
            match chars.next()? {
                (_, '=') => break,
                (_, c) => name.push(c),
            }
        }
        if chars.next()?.1 != '"' {
            return None;
        }
        let mut value = String::new();
        loop {
            match chars.next()?.1 {
                '"' => break,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        }
        labels.push((name.trim().to_string(), value));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn request_counts_sum_other_labels_by_worker() {
        let text = "# HELP rankgate_requests_total x\n# TYPE rankgate_requests_total counter\n\
            rankgate_requests_total{worker=\"http://a:1@0\",status=\"2xx\"} 5\n\
            rankgate_requests_total{status=\"5xx\",worker=\"http://a:1@0\"} 2\n\
            rankgate_requests_total{worker=\"http://a:1@1\",model=\"a \\\"b\\\"\",status=\"2xx\"} 7 1700000000\n\
            rankgate_requests_total_created{worker=\"http://a:1@0\"} 99\n\
            rankgate_requests_total 3\n\
            rankgate_requests_totally{worker=\"x\"} 1\n\
            rankgate_requests_total{worker=\"broken} 1\n\
            rankgate_requests_total{worker=\"http://a:1@2\"} NaN\n";
        let c = request_counts(text);
        assert_eq!(c.len(), 2, "{c:?}");
        assert_eq!(c["http://a:1@0"], 7.0);
        assert_eq!(c["http://a:1@1"], 7.0);
    }

    #[test]
    fn prefill_legs_count_on_their_rank_decode_legs_once() {
        let text = "rankgate_requests_total{worker=\"http://d:1@0\",status=\"200\"} 4\n\
            rankgate_pd_legs_total{worker=\"http://p:1@0\",leg=\"prefill\"} 3\n\
            rankgate_pd_legs_total{worker=\"http://p:1@0\",leg=\"decode\"} 0\n\
            rankgate_pd_legs_total{worker=\"http://d:1@0\",leg=\"decode\"} 4\n\
            rankgate_pd_legs_total{worker=\"http://d:1@0\",leg=\"prefill\"} 0\n";
        let c = request_counts(text);
        assert_eq!(c["http://p:1@0"], 3.0, "{c:?}");
        assert_eq!(c["http://d:1@0"], 4.0, "{c:?}");
    }

    #[test]
    fn rates_are_deltas_over_elapsed_time() {
        let t0 = Instant::now();
        let mut r = Rates::default();
        let counts = |pairs: &[(&str, f64)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect::<HashMap<_, _>>()
        };
        assert_eq!(r.update(t0, counts(&[("a", 10.0), ("b", 4.0)])), None);
        let rates = r
            .update(
                t0 + Duration::from_secs(2),
                counts(&[("a", 20.0), ("b", 1.0), ("c", 3.0)]),
            )
            .unwrap();
        assert_eq!(rates.of("a"), 5.0);
        // Went down: reset, counts from zero.
        assert_eq!(rates.of("b"), 0.5);
        // New since the last poll: counts from zero.
        assert_eq!(rates.of("c"), 1.5);
        // No series: it answered nothing, so 0 (not unknown).
        assert_eq!(rates.of("d"), 0.0);
        // No time passed: no rate rather than a division by zero.
        assert_eq!(
            r.update(t0 + Duration::from_secs(2), counts(&[("a", 30.0)])),
            None
        );
    }
}
