//! What a load run measured: percentiles from HdrHistograms, throughput, errors by kind, requests
//! per worker (every rank of the fleet when it is known, those that served nothing included),
//! and the client's own pacing (achieved vs requested arrival rate, send lag).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde_json::{json, Value};

use super::{ErrorKind, Outcome};

/// All outcomes of a run.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub outcomes: Vec<Outcome>,
    pub elapsed: Duration,
    /// Requests sent per second over the sending window.
    pub achieved_rate: f64,
    /// The open-loop rate asked for, if any.
    pub requested_rate: Option<f64>,
    /// The rate of the planned arrival times themselves: a finite Poisson sample drifts from the
    /// requested rate by chance, so the client's own overhead is achieved vs scheduled.
    pub scheduled_rate: Option<f64>,
    /// The engines' prefix cache over the run: (prompt tokens looked up, tokens found cached),
    /// when the caller could read them (the simulator's counters, or `/metrics` before/after).
    pub prefix_cache: Option<(u64, u64)>,
    /// Every rank of the fleet, when the caller knows it (the router's `/workers`, see
    /// [`super::fleet::ranks`]): the per-worker counts then list each, 0 included. Without it
    /// only the workers some answer named can be listed.
    pub fleet: Vec<String>,
    /// The tenants of a several-tenant run, in the order given (see [`super::tenants`]); each
    /// outcome names its own. Empty for one workload.
    pub tenants: Vec<std::sync::Arc<str>>,
}

/// p50 / p90 / p99 / p99.9 / max in milliseconds, from an HdrHistogram of microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Percentiles {
    pub count: u64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

impl Percentiles {
    pub fn of(values: impl Iterator<Item = Duration>) -> Percentiles {
        // 3 significant figures over 1 µs .. 1 h: about 0.1% error, fixed memory.
        let Ok(mut h) = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3) else {
            return Percentiles::default();
        };
        for v in values {
            h.saturating_record((v.as_micros() as u64).max(1));
        }
        if h.is_empty() {
            return Percentiles::default();
        }
        let ms = |us: u64| us as f64 / 1000.0;
        Percentiles {
            count: h.len(),
            p50: ms(h.value_at_quantile(0.50)),
            p90: ms(h.value_at_quantile(0.90)),
            p99: ms(h.value_at_quantile(0.99)),
            p999: ms(h.value_at_quantile(0.999)),
            max: ms(h.max()),
        }
    }
}

impl Report {
    pub fn ok(&self) -> impl Iterator<Item = &Outcome> {
        self.outcomes.iter().filter(|o| o.error.is_none())
    }

    pub fn errors(&self) -> usize {
        self.outcomes.len() - self.ok().count()
    }

    pub fn errors_by_kind(&self) -> BTreeMap<ErrorKind, usize> {
        let mut m = BTreeMap::new();
        for e in self.outcomes.iter().filter_map(|o| o.error) {
            *m.entry(e).or_default() += 1;
        }
        m
    }

    /// Successful requests per worker: every rank of [`Report::fleet`] (0 for one that served
    /// nothing), and any other worker an answer named. When the router hid the rank of some
    /// answers, the fleet's ranks are not listed: a 0 beside them would be a guess.
    pub fn per_worker(&self) -> BTreeMap<String, usize> {
        let hidden = self.ok().any(|o| o.worker.is_none());
        let fleet = self.fleet.iter().filter(|_| !hidden);
        let mut m: BTreeMap<String, usize> = fleet.map(|w| (w.clone(), 0)).collect();
        for o in self.ok() {
            // No rank named: rankgate hides it (`expose_worker = "none"`) unless asked with the
            // admin token; saying so beats a `-` that reads as "no rank".
            *m.entry(o.worker.clone().unwrap_or_else(|| super::HIDDEN.into()))
                .or_default() += 1;
        }
        m
    }

    pub fn ttft(&self) -> Percentiles {
        self.ttft_of(None)
    }

    pub fn e2e(&self) -> Percentiles {
        self.e2e_of(None)
    }

    fn served_by<'a>(&'a self, worker: Option<&'a str>) -> impl Iterator<Item = &'a Outcome> {
        self.ok()
            .filter(move |o| worker.is_none() || o.worker.as_deref() == worker)
    }

    /// TTFT of the successful requests one worker served (all of them for `None`).
    pub fn ttft_of(&self, worker: Option<&str>) -> Percentiles {
        Percentiles::of(self.served_by(worker).filter_map(|o| o.ttft))
    }

    /// End-to-end time of the successful requests one worker served (all for `None`).
    pub fn e2e_of(&self, worker: Option<&str>) -> Percentiles {
        Percentiles::of(self.served_by(worker).map(|o| o.e2e))
    }

    pub fn itl(&self) -> Percentiles {
        Percentiles::of(self.ok().flat_map(|o| o.itl.iter().copied()))
    }

    pub fn lag(&self) -> Percentiles {
        Percentiles::of(self.outcomes.iter().map(|o| o.lag))
    }

    /// Share of prompt tokens the engines found in their prefix caches.
    pub fn prefix_hit_ratio(&self) -> Option<f64> {
        self.prefix_cache
            .map(|(queries, hits)| hits as f64 / queries.max(1) as f64)
    }

    pub fn requests_per_sec(&self) -> f64 {
        self.ok().count() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    pub fn tokens_per_sec(&self) -> f64 {
        self.ok().map(|o| o.tokens).sum::<u64>() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The full report as JSON.
    pub fn to_json(&self) -> Value {
        json!({
            "requests": self.outcomes.len(),
            "ok": self.ok().count(),
            "errors": self.errors_by_kind(),
            "elapsed_s": self.elapsed.as_secs_f64(),
            "requested_rate": self.requested_rate,
            "scheduled_rate": self.scheduled_rate,
            "achieved_rate": self.achieved_rate,
            "send_lag_ms": self.lag(),
            "requests_per_s": self.requests_per_sec(),
            "tokens_per_s": self.tokens_per_sec(),
            "ttft_ms": self.ttft(),
            "itl_ms": self.itl(),
            "e2e_ms": self.e2e(),
            "per_worker": self.per_worker(),
            "prefix_cache": self.prefix_cache.map(|(q, h)| json!({
                "query_tokens": q, "hit_tokens": h, "hit_ratio": self.prefix_hit_ratio(),
            })),
            "tenants": self.per_tenant(),
        })
    }

    /// A human table.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let rate = match (self.requested_rate, self.scheduled_rate) {
            (Some(r), Some(s)) => format!(
                "{:.2}/s achieved vs {s:.2}/s scheduled ({r:.2}/s requested)",
                self.achieved_rate
            ),
            _ => format!("{:.2}/s achieved", self.achieved_rate),
        };
        let lag = self.lag();
        let _ = writeln!(
            o,
            "{} requests, {} ok, {} errors {:?} in {:.1} s; arrivals {rate}; send lag p99 {:.2} ms",
            self.outcomes.len(),
            self.ok().count(),
            self.errors(),
            self.errors_by_kind(),
            self.elapsed.as_secs_f64(),
            lag.p99
        );
        let _ = writeln!(
            o,
            "throughput {:.2} req/s, {:.1} tokens/s",
            self.requests_per_sec(),
            self.tokens_per_sec()
        );
        let _ = writeln!(
            o,
            "{:<10} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "ms", "p50", "p90", "p99", "p99.9", "max"
        );
        for (name, p) in [
            ("TTFT", self.ttft()),
            ("ITL", self.itl()),
            ("E2E", self.e2e()),
        ] {
            let _ = writeln!(
                o,
                "{name:<10} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
                p.p50, p.p90, p.p99, p.p999, p.max
            );
        }
        if let (Some((q, h)), Some(r)) = (self.prefix_cache, self.prefix_hit_ratio()) {
            let _ = writeln!(
                o,
                "prefix cache: {h} of {q} prompt tokens cached ({:.1}%)",
                100.0 * r
            );
        }
        o.push_str(&self.tenants_table());
        let per = self.per_worker();
        if per.is_empty() {
            // Nothing named a worker (an engine answered directly, or every request failed).
            return o;
        }
        let total = self.ok().count().max(1);
        let hidden = per.contains_key(super::HIDDEN);
        let listed = match (self.fleet.is_empty(), hidden) {
            (_, true) => "the router hides which rank served (with --admin-token it tells)",
            (true, false) => "the workers that answered (--admin lists every rank)",
            (false, false) => "every rank of the fleet",
        };
        let _ = writeln!(o, "per worker, {listed}:");
        for (w, n) in per {
            let share = 100.0 * n as f64 / total as f64;
            let _ = writeln!(o, "  {w:<40} {n:>6} requests {share:>5.1}%");
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hdr_percentiles() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(Percentiles::of(std::iter::empty()).count, 0);
        let p = Percentiles::of(v.iter().copied());
        assert_eq!(p.count, 100);
        assert!(
            (p.p50 - 50.0).abs() < 0.1 && (p.p99 - 99.0).abs() < 0.1 && (p.max - 100.0).abs() < 0.1
        );
    }
}
