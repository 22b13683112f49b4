//! Every query of the dashboard against the page a router really serves (streamed and plain
//! requests through a simulated engine): metrics are families of the page, labels exist where they
//! are used, legends name labels that survive; and promtool parses every expression (ignored
//! without promtool).

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::Command;

use http::StatusCode;
use http_body_util::BodyExt;
use rankgate_sim::sim::SimFlavor;
use serde_json::Value;

use crate::common::*;
use crate::{dashboard::*, promql::*};

/// Families of the page the dashboard leaves out on purpose; every other family must be on it.
const NOT_ON_THE_DASHBOARD: &[&str] = &[
    // The complement of rankgate_rank_telemetry_state{state="unavailable"}, which has the reason.
    "rankgate_rank_telemetry_available",
    // Pending engines are in rankgate_rank_telemetry_state too (reason="shape_unknown"), which
    // the dashboard shows; this count is for the alert RankgateEngineShapeUnknown.
    "rankgate_fleet_engines_pending_shape",
];

/// Labels Prometheus adds to every series it scrapes: legends may name them while an expression
/// keeps them, but selectors and aggregations must use what the page itself has.
const TARGET_LABELS: [&str; 2] = ["instance", "job"];

/// The page: each family's type (from `# TYPE`), and the label names each sample name carries.
pub struct Page {
    pub types: HashMap<String, String>,
    pub labels: HashMap<String, BTreeSet<String>>,
}

fn parse_page(text: &str) -> Page {
    let mut page = Page {
        types: HashMap::new(),
        labels: HashMap::new(),
    };
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, ty) = rest.split_once(' ').expect("TYPE line");
            page.types.insert(name.to_string(), ty.to_string());
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).expect("sample line");
        let names = page.labels.entry(line[..name_end].to_string()).or_default();
        // Label values are quoted and may hold `,` or `=`: split outside quotes only.
        let mut rest = line[name_end..].strip_prefix('{').unwrap_or("}");
        while let Some(eq) = rest.find('=').filter(|_| !rest.starts_with('}')) {
            names.insert(rest[..eq].to_string());
            let mut escaped = false;
            let close = rest[eq + 2..]
                .find(|c| {
                    let end = c == '"' && !escaped;
                    escaped = c == '\\' && !escaped;
                    end
                })
                .expect("closed label value");
            rest = rest[eq + 2 + close + 1..].trim_start_matches(',');
        }
    }
    page
}

/// The `{{label}}`s of a legend format.
fn legend_labels(legend: &str) -> Vec<&str> {
    legend
        .split("{{")
        .skip(1)
        .filter_map(|s| Some(s.split_once("}}")?.0.trim()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_query_of_the_dashboard_reads_metrics_and_labels_the_router_serves() {
    // Prefix caching on: the engine's prefix-cache counters are on the page too.
    let e = engine(rankgate_sim::sim::SimConfig {
        prefix_caching: true,
        ..sim(SimFlavor::Vllm, 2, 0)
    })
    .await;
    // A prefill and a decode server of a model of their own: the per-rank leg counters are on
    // the page only for a fleet that has them. The requests below are for the other model,
    // served whole.
    let prefill = engine(serving(&["pd-model"], 1, 0)).await;
    let decode = engine(serving(&["pd-model"], 1, 0)).await;
    let table = |url: String, keys: &str| {
        format!("[[engines]]\nurl = \"{url}\"\nflavor = \"vllm\"\n{keys}\n")
    };
    let r = router(
        FAST,
        &[
            table(e.url(), "dp_size = 2"),
            table(prefill.url(), "dp_size = 1\nrole = \"prefill\""),
            table(decode.url(), "dp_size = 1\nrole = \"decode\""),
        ],
    )
    .await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    wait_models(&r).await;
    // Streamed and plain completions on the engine, and answers rankgate writes itself.
    for _ in 0..2 {
        let s = stream_chat(r.addr, 8).await;
        assert_eq!(s.status(), StatusCode::OK);
        s.into_body().collect().await.expect("stream body");
        assert_eq!(chat(r.addr, 2).await.status, StatusCode::OK);
    }
    assert_eq!(get(r.addr, "/v1/models").await.status, StatusCode::OK);
    assert_eq!(
        get(r.addr, "/no/such/path").await.status,
        StatusCode::NOT_FOUND
    );
    let reply = get(r.admin_addr, "/metrics").await;
    assert_eq!(reply.status, StatusCode::OK);
    let text = String::from_utf8(reply.body.to_vec()).unwrap();
    let page = parse_page(&text);
    r.shutdown().await;

    let dash = dashboard();
    let mut used = BTreeSet::new();
    let mut errors = Vec::new();
    for (at, expr, legend) in queries(&dash) {
        match read(&expr, &page) {
            Ok((families, v)) => {
                used.extend(families);
                let Val::Vector { labels, target } = &v else {
                    continue;
                };
                for l in legend_labels(&legend) {
                    let by_target = *target && TARGET_LABELS.contains(&l);
                    if !labels.contains(l) && !by_target {
                        errors.push(format!("{at}: legend {{{{{l}}}}} not in {:?}", v.labels()));
                    }
                }
            }
            Err(e) => errors.push(format!("{at}: {e}\n    {expr}")),
        }
    }
    for (name, v) in variables(&dash) {
        let Some(args) =
            (variable_query(v).strip_prefix("label_values(")).and_then(|q| q.strip_suffix(')'))
        else {
            continue;
        };
        let (selector, label) = args.rsplit_once(',').expect("label_values(metric, label)");
        match read(selector, &page) {
            Ok((families, v)) if v.labels().contains(label.trim()) => used.extend(families),
            Ok((_, v)) => errors.push(format!("variable {name}: {label} not in {v:?}")),
            Err(e) => errors.push(format!("variable {name}: {e}")),
        }
    }
    assert!(
        errors.is_empty(),
        "{}\n\nthe page:\n{text}",
        errors.join("\n")
    );
    let left_out: Vec<_> = (page.types.keys())
        .filter(|f| !used.contains(*f) && !NOT_ON_THE_DASHBOARD.contains(&f.as_str()))
        .collect();
    assert!(
        left_out.is_empty(),
        "families on no panel (add them, or to NOT_ON_THE_DASHBOARD with why): {left_out:?}"
    );
}

/// `promtool check rules` over every expression of the dashboard as a recording rule
/// (Grafana's variables replaced by values). promtool is Debian's `prometheus` package, which
/// `.ci/run` installs and with which it runs this test (`--ignored`); without it the test is
/// reported ignored, never passed.
#[test]
#[ignore = "needs promtool (Debian package prometheus): .ci/run installs it and runs this test"]
fn promtool_parses_every_dashboard_query() {
    let dash = dashboard();
    let rules: Vec<Value> = queries(&dash)
        .iter()
        .enumerate()
        .map(|(i, (_, expr, _))| {
            let expr = (expr.replace("$__rate_interval", "1m"))
                .replace("$model", ".*")
                .replace("$worker", ".*");
            serde_json::json!({"record": format!("dashboard:query_{i}"), "expr": expr})
        })
        .collect();
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("grafana-rules.json");
    let doc = serde_json::json!({"groups": [{"name": "dashboard", "rules": rules}]});
    std::fs::write(&file, doc.to_string()).unwrap();
    let out = Command::new("promtool")
        .arg("check")
        .arg("rules")
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("promtool: {e} (install the Debian package prometheus)"));
    assert!(
        out.status.success(),
        "promtool check rules:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
