//! Several tenants at once: each its own workload (arrivals, sizes, headers) against the same
//! router, run side by side and merged into one report whose outcomes say whose they are; and
//! what each tenant got: requests sent, completed and refused (429 and 503 apart), its TTFT,
//! the output tokens it was served against those it asked for.
//!
//! A tenant is named to the router by headers: its fairness id and its objective (the names of
//! the Gateway API Inference Extension, which rankgate's flow control reads).

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::task::JoinSet;

use super::report::{Percentiles, Report};
use super::{run, Workload};

/// The header naming the tenant a request is fair-shared for.
pub const FAIRNESS_HEADER: &str = "x-gateway-inference-fairness-id";
/// The header naming the request's objective (its priority class).
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";

/// One tenant of a run: its name in the report and its workload (headers included).
#[derive(Debug, Clone)]
pub struct Tenant {
    pub name: Arc<str>,
    pub workload: Workload,
}

/// Runs every tenant's workload at the same time and merges the reports: outcomes tagged with
/// their tenant, rates summed, the run as long as its longest tenant.
pub async fn run_tenants(tenants: &[Tenant]) -> Result<Report, String> {
    let mut names = Vec::new();
    for t in tenants {
        if names.contains(&t.name) {
            return Err(format!("tenant {:?} is named twice", t.name));
        }
        names.push(t.name.clone());
    }
    let mut tasks = JoinSet::new();
    for (i, t) in tenants.iter().enumerate() {
        let t = t.clone();
        tasks.spawn(async move { (i, t.name.clone(), run(&t.workload).await) });
    }
    let mut parts = Vec::new();
    while let Some(done) = tasks.join_next().await {
        let (i, name, report) = done.map_err(|e| format!("a tenant's run failed: {e}"))?;
        parts.push((
            i,
            report.map_err(|e| format!("tenant {name:?}: {e}"))?,
            name,
        ));
    }
    parts.sort_by_key(|p| p.0);
    let mut merged = Report {
        tenants: names,
        requested_rate: Some(0.0),
        scheduled_rate: Some(0.0),
        ..Report::default()
    };
    let add = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a + b);
    for (_, r, name) in parts {
        merged.elapsed = merged.elapsed.max(r.elapsed);
        merged.achieved_rate += r.achieved_rate;
        merged.requested_rate = add(merged.requested_rate, r.requested_rate);
        merged.scheduled_rate = add(merged.scheduled_rate, r.scheduled_rate);
        merged.outcomes.extend(r.outcomes.into_iter().map(|mut o| {
            o.tenant = Some(name.clone());
            o
        }));
    }
    merged.outcomes.sort_by_key(|o| o.sent);
    Ok(merged)
}

/// What one tenant got.
#[derive(Debug, Clone, Serialize)]
pub struct TenantStats {
    pub name: String,
    pub sent: usize,
    pub completed: usize,
    pub failed: usize,
    /// Of the failed: answered 429 (queue full, rejected by flow control or rate limits).
    pub rejected_429: usize,
    /// Of the failed: answered 503 (nothing could serve it, or it waited too long).
    pub unavailable_503: usize,
    pub ttft_ms: Percentiles,
    /// Output tokens of the completed requests.
    pub tokens: u64,
    pub tokens_per_s: f64,
    /// Output tokens all its sent requests asked for (`max_tokens`).
    pub demand_tokens: u64,
    /// `tokens / demand_tokens`: how much of what it asked for it was served.
    pub demand_served: f64,
}

impl Report {
    /// Each tenant's results, in the order the tenants were given; empty for a one-workload run.
    pub fn per_tenant(&self) -> Vec<TenantStats> {
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        (self.tenants.iter())
            .map(|name| {
                let mine: Vec<_> = (self.outcomes.iter())
                    .filter(|o| o.tenant.as_ref() == Some(name))
                    .collect();
                let ok = || mine.iter().filter(|o| o.error.is_none());
                let failed = |status: u16| {
                    (mine.iter())
                        .filter(|o| o.error.is_some() && o.status == status)
                        .count()
                };
                let tokens: u64 = ok().map(|o| o.tokens).sum();
                let demand: u64 = mine.iter().map(|o| o.asked).sum();
                TenantStats {
                    name: name.to_string(),
                    sent: mine.len(),
                    completed: ok().count(),
                    failed: mine.len() - ok().count(),
                    rejected_429: failed(429),
                    unavailable_503: failed(503),
                    ttft_ms: Percentiles::of(ok().filter_map(|o| o.ttft)),
                    tokens,
                    tokens_per_s: tokens as f64 / secs,
                    demand_tokens: demand,
                    demand_served: tokens as f64 / demand.max(1) as f64,
                }
            })
            .collect()
    }

    /// The per-tenant lines of the human table (nothing for a one-workload run).
    pub(super) fn tenants_table(&self) -> String {
        let stats = self.per_tenant();
        if stats.is_empty() {
            return String::new();
        }
        let mut o = format!(
            "per tenant:\n  {:<16} {:>6} {:>6} {:>6} {:>5} {:>5} {:>9} {:>9} {:>9} {:>9} {:>7}\n",
            "tenant",
            "sent",
            "ok",
            "failed",
            "429",
            "503",
            "TTFT p50",
            "TTFT p99",
            "tokens/s",
            "demand",
            "served"
        );
        for t in stats {
            o.push_str(&format!(
                "  {:<16} {:>6} {:>6} {:>6} {:>5} {:>5} {:>9.1} {:>9.1} {:>9.1} {:>9} {:>6.1}%\n",
                t.name,
                t.sent,
                t.completed,
                t.failed,
                t.rejected_429,
                t.unavailable_503,
                t.ttft_ms.p50,
                t.ttft_ms.p99,
                t.tokens_per_s,
                t.demand_tokens,
                100.0 * t.demand_served
            ));
        }
        o
    }
}

/// How long a tenant's workload may run: its own duration, never past the run's.
pub fn bounded(own: Option<Duration>, run: Duration) -> Duration {
    own.map_or(run, |d| d.min(run))
}

#[cfg(test)]
mod tests {
    use super::super::{ErrorKind, Outcome};
    use super::*;

    fn outcome(tenant: &Arc<str>, status: u16, tokens: u64, asked: u64) -> Outcome {
        let ok = status == 200;
        Outcome {
            status,
            error: (!ok).then_some(ErrorKind::Http4xx),
            ttft: ok.then_some(Duration::from_millis(10 * tokens)),
            tokens,
            asked,
            tenant: Some(tenant.clone()),
            ..Outcome::failed(ErrorKind::Connect, Duration::ZERO)
        }
    }

    #[test]
    fn each_tenant_counts_its_own_and_the_counts_add_up() {
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        let r = Report {
            outcomes: vec![
                outcome(&a, 200, 8, 8),
                outcome(&a, 200, 4, 8),
                outcome(&a, 429, 0, 8),
                outcome(&b, 503, 0, 16),
                outcome(&b, 200, 16, 16),
                outcome(&b, 500, 0, 16),
            ],
            elapsed: Duration::from_secs(2),
            tenants: vec![b.clone(), a.clone()],
            ..Report::default()
        };
        let s = r.per_tenant();
        assert_eq!(
            s.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
            ["b", "a"]
        );
        let (sb, sa) = (&s[0], &s[1]);
        assert_eq!((sa.sent, sa.completed, sa.failed), (3, 2, 1));
        assert_eq!((sa.rejected_429, sa.unavailable_503), (1, 0));
        assert_eq!((sa.tokens, sa.demand_tokens), (12, 24));
        assert!((sa.demand_served - 0.5).abs() < 1e-9 && (sa.tokens_per_s - 6.0).abs() < 1e-9);
        assert_eq!((sb.sent, sb.completed, sb.failed), (3, 1, 2));
        assert_eq!((sb.rejected_429, sb.unavailable_503), (0, 1));
        assert_eq!(sb.ttft_ms.count, 1);
        assert_eq!(s.iter().map(|t| t.sent).sum::<usize>(), r.outcomes.len());
        let table = r.tenants_table();
        assert!(
            table.contains("per tenant") && table.contains("50.0%"),
            "{table}"
        );
        assert!(Report::default().per_tenant().is_empty());
        assert_eq!(
            bounded(Some(Duration::from_secs(9)), Duration::from_secs(5)).as_secs(),
            5
        );
    }
}
