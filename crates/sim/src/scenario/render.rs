//! Scenario results as text (a comparison table and per-rank tables, in Markdown so the doc can
//! take them as they are), as JSON, and as an SVG chart of per-rank KV usage over time.

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::{PolicyRun, Scenario};
use crate::load::report::Percentiles;

/// Milliseconds, or "-" where the rank served nothing to measure.
fn ms(p: &Percentiles, v: f64) -> String {
    if p.count == 0 {
        "-".into()
    } else {
        format!("{v:.0}")
    }
}

/// Milliseconds to one decimal (inter-token gaps are a few ms), or "-" with nothing measured.
fn ms1(p: &Percentiles, v: f64) -> String {
    if p.count == 0 {
        "-".into()
    } else {
        format!("{v:.1}")
    }
}

/// The comparison table and one per-rank table per policy.
pub fn markdown(s: &Scenario, runs: &[PolicyRun]) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "| policy | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | E2E p50 ms | E2E p99 ms | req/s | tokens/s | errors | prefix hits | highest peak KV | arrivals/s achieved / scheduled / requested | sent to dark ranks |");
    let _ = writeln!(
        o,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in runs {
        let (t, e, itl) = (r.report.ttft(), r.report.e2e(), r.report.itl());
        let dark: usize = r.ranks.iter().map(|x| x.sent_while_dark).sum();
        let early: usize = r.ranks.iter().map(|x| x.sent_before_detection).sum();
        let f = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.1}"));
        let (requested, scheduled) = (f(r.report.requested_rate), f(r.report.scheduled_rate));
        let _ = writeln!(
            o,
            "| {} | {:.0} | {:.0} | {} | {} | {:.0} | {:.0} | {:.2} | {:.0} | {} | {} | {:.0}% | {:.1} / {scheduled} / {requested} | {dark} (+{early} in the first 2 polls) |",
            r.label(),
            t.p50,
            t.p99,
            ms1(&itl, itl.p50),
            ms1(&itl, itl.p99),
            e.p50,
            e.p99,
            r.report.requests_per_sec(),
            r.report.tokens_per_sec(),
            r.report.errors(),
            r.report
                .prefix_hit_ratio()
                .map_or("-".into(), |h| format!("{:.1}%", 100.0 * h)),
            100.0 * r.ranks.iter().map(|x| x.peak_kv).fold(0.0, f64::max),
            r.report.achieved_rate,
        );
    }
    if !s.workload.tenants.is_empty() {
        o.push_str(&tenants(runs));
    }
    if s.engines.iter().any(|e| e.serves_adapters()) {
        let _ = writeln!(
            o,
            "\n| policy | LoRA slot waits | slot loads |\n|---|---|---|"
        );
        for r in runs {
            let sum = |f: fn(&super::RankResult) -> u64| r.ranks.iter().map(f).sum::<u64>();
            let (waits, loads) = (sum(|x| x.lora_slot_waits), sum(|x| x.lora_loads));
            let _ = writeln!(o, "| {} | {waits} | {loads} |", r.label());
        }
    }
    if !s.routes.is_empty() {
        let _ = writeln!(
            o,
            "\n| policy | requests served, by model sent to the engine |\n|---|---|"
        );
        for r in runs {
            let all: usize = r.models.iter().map(|(_, n)| n).sum();
            let by: Vec<String> = (r.models.iter())
                .map(|(m, n)| format!("{m} {n} ({:.1}%)", 100.0 * *n as f64 / all.max(1) as f64))
                .collect();
            let _ = writeln!(o, "| {} | {} |", r.label(), by.join(", "));
        }
    }
    if let Some(last) = s.events.iter().map(|e| e.at.0).max() {
        let _ = writeln!(
            o,
            "\nFrom the timeline's last event ({} s) to the end:\n",
            last.as_secs()
        );
        let _ = writeln!(
            o,
            "| policy | prefix hits | TTFT p50 ms | TTFT p99 ms | requests |"
        );
        let _ = writeln!(o, "|---|---|---|---|---|");
        for r in runs {
            let after = crate::load::report::Percentiles::of(
                r.report
                    .ok()
                    .filter(|x| x.sent >= last)
                    .filter_map(|x| x.ttft),
            );
            let hits = r
                .prefix_after_events
                .filter(|(q, _)| *q > 0)
                .map_or("-".into(), |(q, h)| {
                    format!("{:.1}%", 100.0 * h as f64 / q as f64)
                });
            let n = r.report.ok().filter(|x| x.sent >= last).count();
            let _ = writeln!(
                o,
                "| {} | {hits} | {:.0} | {:.0} | {n} |",
                r.label(),
                after.p50,
                after.p99
            );
        }
    }
    for r in runs {
        let total = r.report.ok().count().max(1);
        // A disaggregated scenario's tables say each rank's part and the legs it received (its
        // prefill legs are in no client's answer, so `served` counts only decode legs).
        let pd = s.disaggregated();
        let _ = writeln!(o, "\n`{}` per rank ({}):\n", r.label(), s.name);
        let (head, rule) = match pd {
            true => (" role | legs |", "---|---|"),
            false => ("", ""),
        };
        let _ = writeln!(o, "| rank | worker |{head} served | share | peak KV | prefix hits | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | E2E p99 ms |");
        let _ = writeln!(o, "|---|---|{rule}---|---|---|---|---|---|---|---|");
        for x in &r.ranks {
            let part = match pd {
                true => format!(" {} | {} |", x.role.unwrap_or("both"), x.legs),
                false => String::new(),
            };
            let ttft = r.report.ttft_of(Some(&x.id));
            let e2e = r.report.e2e_of(Some(&x.id));
            let _ = writeln!(
                o,
                "| {} | {} |{part} {} | {:.0}% | {:.0}% | {:.0}% | {} | {} | {} | {} |",
                x.rank,
                x.id.trim_start_matches("http://"),
                x.served,
                100.0 * x.served as f64 / total as f64,
                100.0 * x.peak_kv,
                100.0 * x.prefix_hits as f64 / x.prefix_queries.max(1) as f64,
                ms(&ttft, ttft.p50),
                ms(&ttft, ttft.p99),
                ms(&e2e, e2e.p50),
                ms(&e2e, e2e.p99),
            );
        }
    }
    o
}

/// One row per variant and tenant: what each tenant sent, what it got, and how much of the
/// output it asked for it was served.
fn tenants(runs: &[PolicyRun]) -> String {
    let mut o = String::from("\nPer tenant:\n\n| policy | tenant | sent | completed | failed | of which 429 | of which 503 | TTFT p50 ms | TTFT p99 ms | output tokens | tokens/s | demand tokens | demand served |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in runs {
        for t in r.report.per_tenant() {
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {} | {:.1}% |",
                r.label(),
                t.name,
                t.sent,
                t.completed,
                t.failed,
                t.rejected_429,
                t.unavailable_503,
                ms(&t.ttft_ms, t.ttft_ms.p50),
                ms(&t.ttft_ms, t.ttft_ms.p99),
                t.tokens,
                t.tokens_per_s,
                t.demand_tokens,
                100.0 * t.demand_served,
            );
        }
    }
    o
}

/// The whole result as JSON: each policy's full load report plus per-rank results.
pub fn to_json(s: &Scenario, runs: &[PolicyRun]) -> Value {
    json!({
        "scenario": s.name,
        "description": s.description,
        "policies": runs.iter().map(|r| json!({
            "policy": r.policy.as_str(),
            "label": r.label(),
            "disaggregated": r.disaggregated,
            "replicas": r.replicas,
            "report": r.report.to_json(),
            "ranks": r.ranks,
            "models": r.models.iter().map(|(m, n)| json!({"model": m, "requests": n})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// Per-rank KV usage over time, one panel per policy, stacked.
pub fn svg(s: &Scenario, runs: &[PolicyRun]) -> String {
    let (w, ph, left, top, gap) = (760.0, 180.0, 50.0, 46.0, 50.0);
    let plot_w = w - left - 150.0;
    let height = top + runs.len() as f64 * (ph + gap);
    let t_max = runs
        .iter()
        .filter_map(|r| r.kv_series.last().map(|(t, _)| *t))
        .fold(1.0, f64::max);
    let mut o = String::new();
    let _ = writeln!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(o, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        o,
        r#"<text x="{left}" y="18" font-size="13">{}: KV usage per rank over time</text>"#,
        escape(&s.name)
    );
    for (p, run) in runs.iter().enumerate() {
        let y0 = top + p as f64 * (ph + gap);
        let _ = writeln!(
            o,
            r##"<rect x="{left}" y="{y0}" width="{plot_w}" height="{ph}" fill="none" stroke="#888"/>"##
        );
        let _ = writeln!(
            o,
            r#"<text x="{left}" y="{}" font-size="12">{}</text>"#,
            y0 - 4.0,
            run.label()
        );
        for pct in [0, 50, 100] {
            let y = y0 + ph - ph * pct as f64 / 100.0;
            let _ = writeln!(
                o,
                r##"<text x="{}" y="{}" text-anchor="end">{pct}%</text><line x1="{left}" x2="{}" y1="{y}" y2="{y}" stroke="#eee"/>"##,
                left - 4.0,
                y + 4.0,
                left + plot_w
            );
        }
        let _ = writeln!(
            o,
            r#"<text x="{}" y="{}" text-anchor="end">{:.0} s</text>"#,
            left + plot_w,
            y0 + ph + 14.0,
            t_max
        );
        for (i, rank) in run.ranks.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let points: Vec<String> = run
                .kv_series
                .iter()
                .map(|(t, kv)| {
                    format!(
                        "{:.1},{:.1}",
                        left + plot_w * t / t_max,
                        y0 + ph - ph * kv.get(i).copied().unwrap_or(0.0)
                    )
                })
                .collect();
            let _ = writeln!(
                o,
                r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"/>"#,
                points.join(" ")
            );
            let ly = y0 + 14.0 + 16.0 * i as f64;
            let _ = writeln!(
                o,
                r#"<rect x="{}" y="{}" width="10" height="10" fill="{color}"/><text x="{}" y="{}">{} ({} req)</text>"#,
                left + plot_w + 10.0,
                ly - 9.0,
                left + plot_w + 24.0,
                ly,
                rank.id.trim_start_matches("http://"),
                rank.served
            );
        }
    }
    o.push_str("</svg>\n");
    o
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
