//! rankgate's own `/metrics` over real sockets: scraped while simulated engines serve traffic,
//! the page is valid Prometheus text (checked here line by line, and by `promtool check metrics`
//! in a test ignored without promtool, which `.ci/run` installs and runs it with);
//! requests carry their model, route, status and worker; time to first byte is observed once
//! per stream; clients cannot multiply series; a removed worker's series leave the page.

mod common;

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use rankgate::app::Router;
use rankgate::config::Config;
use rankgate_sim::sim::{SimConfig, DEFAULT_MODEL};
use serde_json::json;

use common::*;

async fn scrape(r: &Router) -> String {
    let reply = get(r.admin_addr, "/metrics").await;
    assert_eq!(reply.status, StatusCode::OK);
    let ct = reply.headers["content-type"].to_str().unwrap();
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    String::from_utf8(reply.body.to_vec()).unwrap()
}

/// The value of the one sample named exactly `series` (name and labels), if present.
fn sample(page: &str, series: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// The sum of every sample of `name` whose labels include all of `labels`.
fn sum(page: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let want: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    page.lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{')))
        .filter(|l| want.iter().all(|w| l.contains(w.as_str())))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

// ---- A strict checker of the Prometheus text format (0.0.4) ----

fn is_metric_name(s: &str) -> bool {
    let mut b = s.bytes();
    b.next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_' || c == b':')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b':')
}

fn is_label_name(s: &str) -> bool {
    let mut b = s.bytes();
    !s.starts_with("__")
        && b.next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_')
}

/// One sample line: its name, labels (in order) and value.
type Sample = (String, Vec<(String, String)>, f64);

/// `name{a="x",b="y"} value` split into its name, labels (in order) and value.
fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line.find(['{', ' ']).ok_or("no value")?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        let mut r = r;
        loop {
            if let Some(after) = r.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = r.find('=').ok_or("label without =")?;
            let key = &r[..eq];
            let mut chars = r[eq + 1..]
                .strip_prefix('"')
                .ok_or("unquoted label value")?
                .chars();
            let mut value = String::new();
            loop {
                match chars.next().ok_or("unterminated label value")? {
                    '"' => break,
                    '\\' => match chars.next() {
                        Some('\\') => value.push('\\'),
                        Some('"') => value.push('"'),
                        Some('n') => value.push('\n'),
                        other => return Err(format!("bad escape \\{other:?}")),
                    },
                    '\n' => return Err("raw newline in label value".into()),
                    c => value.push(c),
                }
            }
            labels.push((key.to_string(), value));
            r = chars.as_str();
            r = r.strip_prefix(',').unwrap_or(r);
        }
    }
    let value = rest.strip_prefix(' ').ok_or("no space before the value")?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse().map_err(|e| format!("value {v:?}: {e}"))?,
    };
    Ok((name.to_string(), labels, value))
}

/// Checks `page` as the Prometheus text format with promtool's lint rules: every family has one
/// HELP and one TYPE before its samples, which are contiguous; names and labels are well
/// formed, no series twice; counters end in `_total` and never go negative; histograms have
/// sorted, cumulative buckets ending in `+Inf` equal to `_count`, and a `_sum`. Returns the
/// families and their types.
fn check_exposition(page: &str) -> HashMap<String, String> {
    let mut types: HashMap<String, String> = HashMap::new();
    let mut helped: HashSet<String> = HashSet::new();
    let mut done: HashSet<String> = HashSet::new();
    let mut current: Option<String> = None;
    let mut seen: HashSet<String> = HashSet::new();
    // Per histogram series (labels without `le`): buckets, sum, count.
    type Hist = (Vec<(f64, f64)>, Option<f64>, Option<f64>);
    let mut hists: HashMap<String, Hist> = HashMap::new();
    assert!(page.ends_with('\n'), "the page ends with a newline");
    for (n, line) in page.lines().enumerate() {
        let fail = |why: &str| -> ! { panic!("line {}: {why}: {line:?}", n + 1) };
        if line.is_empty() {
            fail("empty line");
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest
                .split_once(' ')
                .unwrap_or_else(|| fail("HELP without text"));
            if !is_metric_name(name) || help.trim().is_empty() {
                fail("bad HELP");
            }
            if !helped.insert(name.to_string()) || done.contains(name) {
                fail("second HELP");
            }
            if let Some(c) = current.replace(name.to_string()) {
                if c != name {
                    done.insert(c);
                }
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, ty) = rest
                .split_once(' ')
                .unwrap_or_else(|| fail("TYPE without type"));
            if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&ty) {
                fail("unknown type");
            }
            if current.as_deref() != Some(name) || types.contains_key(name) {
                fail("TYPE not right after its HELP, or twice");
            }
            if ty == "counter" && !name.ends_with("_total") {
                fail("counter not named _total");
            }
            if ty != "counter" && name.ends_with("_total") {
                fail("_total on a non-counter");
            }
            types.insert(name.to_string(), ty.to_string());
            continue;
        }
        if line.starts_with('#') {
            fail("comment that is not HELP or TYPE");
        }
        let (name, labels, value) = parse_sample(line).unwrap_or_else(|e| fail(&e));
        let family = current
            .clone()
            .unwrap_or_else(|| fail("sample before any HELP"));
        let ty = types
            .get(&family)
            .unwrap_or_else(|| fail("sample before its TYPE"));
        let suffix = name
            .strip_prefix(family.as_str())
            .unwrap_or_else(|| fail("sample outside its family"));
        let ok = match ty.as_str() {
            "histogram" => ["_bucket", "_sum", "_count"].contains(&suffix),
            _ => suffix.is_empty(),
        };
        if !ok || !is_metric_name(&name) {
            fail("sample name does not fit its family");
        }
        let mut keys = HashSet::new();
        for (k, _) in &labels {
            if !is_label_name(k) || !keys.insert(k.clone()) {
                fail("bad or repeated label name");
            }
        }
        let mut sorted = labels.clone();
        sorted.sort();
        if !seen.insert(format!("{name}{sorted:?}")) {
            fail("series twice");
        }
        if ty == "counter" && (value.is_nan() || value < 0.0) {
            fail("negative counter");
        }
        if ty == "histogram" {
            let key: Vec<_> = sorted.iter().filter(|(k, _)| k != "le").collect();
            let h = hists.entry(format!("{family}{key:?}")).or_default();
            match suffix {
                "_bucket" => {
                    let le = labels
                        .iter()
                        .find(|(k, _)| k == "le")
                        .unwrap_or_else(|| fail("bucket without le"));
                    let le = match le.1.as_str() {
                        "+Inf" => f64::INFINITY,
                        v => v.parse().unwrap_or_else(|_| fail("bad le")),
                    };
                    h.0.push((le, value));
                }
                "_sum" => h.1 = Some(value),
                _ => h.2 = Some(value),
            }
        }
    }
    for name in &helped {
        assert!(types.contains_key(name), "{name} has HELP but no TYPE");
    }
    for (series, (buckets, sum, count)) in &hists {
        let count = count.unwrap_or_else(|| panic!("{series}: no _count"));
        assert!(sum.is_some(), "{series}: no _sum");
        assert!(
            buckets
                .windows(2)
                .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1),
            "{series}: buckets not sorted and cumulative: {buckets:?}"
        );
        let last = buckets
            .last()
            .unwrap_or_else(|| panic!("{series}: no buckets"));
        assert_eq!(last.0, f64::INFINITY, "{series}: no +Inf bucket");
        assert_eq!(last.1, count, "{series}: +Inf bucket != _count");
    }
    types
}

/// `promtool check metrics` on `page`: no complaint at all.
fn promtool(page: &str) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("promtool: {e} (install the Debian package prometheus)"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(page.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics:\n{said}\n{page}"
    );
}

/// The families the page always has, by type.
const FAMILIES: [(&str, &str); 28] = [
    ("rankgate_build_info", "gauge"),
    ("rankgate_retries_total", "counter"),
    ("rankgate_retries_refused_total", "counter"),
    ("rankgate_skipped_unavailable_total", "counter"),
    ("rankgate_streams_cut_total", "counter"),
    ("rankgate_requests_total", "counter"),
    ("rankgate_local_responses_total", "counter"),
    ("rankgate_request_duration_seconds", "histogram"),
    ("rankgate_time_to_first_byte_seconds", "histogram"),
    ("rankgate_worker_info", "gauge"),
    ("rankgate_fleet_ranks", "gauge"),
    ("rankgate_rank_telemetry_state", "gauge"),
    ("rankgate_rank_telemetry_available", "gauge"),
    ("rankgate_rank_telemetry_age_seconds", "gauge"),
    ("rankgate_rank_kv_usage_ratio", "gauge"),
    ("rankgate_rank_running_requests", "gauge"),
    ("rankgate_rank_waiting_requests", "gauge"),
    ("rankgate_rank_in_flight_requests", "gauge"),
    ("rankgate_rank_ejected", "gauge"),
    ("rankgate_ejections_total", "counter"),
    ("rankgate_upstream_attempts_total", "counter"),
    ("rankgate_telemetry_invalid_entries_total", "counter"),
    ("rankgate_telemetry_polls_total", "counter"),
    ("rankgate_telemetry_poll_failures_total", "counter"),
    ("rankgate_telemetry_bad_lines_total", "counter"),
    ("rankgate_telemetry_unmanaged_entries_total", "counter"),
    ("process_cpu_seconds_total", "counter"),
    ("process_open_fds", "gauge"),
];

/// A router's page while four streams are in flight (after an answered, a refused and an
/// unknown request), and once they have ended; with the engine's URL.
async fn pages_with_traffic() -> (String, String, String) {
    let (e, r) = fleet(sim(rankgate_sim::sim::SimFlavor::Vllm, 2, 0)).await;
    wait_state(&r, &[0, 1], "available").await;
    let mut streams = Vec::new();
    for _ in 0..4 {
        let s = stream_chat(r.addr, 40).await;
        assert_eq!(s.status(), StatusCode::OK);
        streams.push(s);
    }
    assert_eq!(chat(r.addr, 2).await.status, StatusCode::OK);
    assert_eq!(get(r.addr, "/v1/models").await.status, StatusCode::OK);
    assert_eq!(
        get(r.addr, "/no/such/path").await.status,
        StatusCode::NOT_FOUND
    );
    let during = scrape(&r).await;
    for s in streams {
        s.into_body().collect().await.expect("stream body");
    }
    let after = scrape(&r).await;
    r.shutdown().await;
    (during, after, e.url())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_is_valid_prometheus_text_while_traffic_flows() {
    let (page, after, url) = pages_with_traffic().await;
    let types = check_exposition(&page);
    for (name, ty) in FAMILIES {
        assert_eq!(
            types.get(name).map(String::as_str),
            Some(ty),
            "{name} in\n{page}"
        );
    }
    let worker = format!("{url}@0");
    for series in [
        format!("rankgate_rank_in_flight_requests{{worker=\"{worker}\"}}"),
        format!("rankgate_rank_telemetry_state{{worker=\"{worker}\",state=\"available\",reason=\"none\"}}"),
        "rankgate_fleet_ranks{state=\"available\"}".to_string(),
        format!("rankgate_telemetry_polls_total{{engine=\"{url}\",source=\"prometheus\",result=\"ok\"}}"),
    ] {
        assert!(sample(&page, &series).is_some(), "no {series} in\n{page}");
    }
    assert_eq!(
        sample(&page, "rankgate_fleet_ranks{state=\"available\"}"),
        Some(2.0)
    );
    assert!(
        sum(&page, "rankgate_rank_in_flight_requests", &[]) >= 4.0,
        "{page}"
    );
    assert!(sample(&page, "process_resident_memory_bytes").is_some_and(|v| v > 0.0));
    check_exposition(&after);
}

/// The same pages through `promtool check metrics`. promtool is Debian's `prometheus` package,
/// which `.ci/run` installs and with which it runs this test (`--ignored`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs promtool (Debian package prometheus): .ci/run installs it and runs this test"]
async fn promtool_accepts_the_page_while_traffic_flows() {
    let (during, after, _) = pages_with_traffic().await;
    promtool(&during);
    promtool(&after);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_to_first_byte_is_observed_once_per_stream() {
    let (_e, r) = fleet(sim(rankgate_sim::sim::SimFlavor::Vllm, 2, 0)).await;
    wait_state(&r, &[0, 1], "available").await;
    wait_models(&r).await;
    let count = |page: &str| {
        sample(
            page,
            &format!("rankgate_time_to_first_byte_seconds_count{{model=\"{DEFAULT_MODEL}\"}}"),
        )
        .unwrap_or(0.0)
    };
    // One to label the model's series, then the count from there.
    chat(r.addr, 1).await;
    let before = count(&scrape(&r).await);
    const N: usize = 7;
    let mut streams = Vec::new();
    for _ in 0..N {
        streams.push(stream_chat(r.addr, 12).await);
    }
    // Answers rankgate writes itself carry no engine byte: not observed.
    assert_eq!(get(r.addr, "/nowhere").await.status, StatusCode::NOT_FOUND);
    assert_eq!(get(r.addr, "/v1/models").await.status, StatusCode::OK);
    for s in streams {
        let body = s
            .into_body()
            .collect()
            .await
            .expect("stream body")
            .to_bytes();
        assert!(body.ends_with(b"data: [DONE]\n\n"));
    }
    let page = scrape(&r).await;
    assert_eq!(count(&page) - before, N as f64, "{page}");
    let duration = sample(
        &page,
        &format!("rankgate_request_duration_seconds_count{{model=\"{DEFAULT_MODEL}\"}}"),
    )
    .unwrap();
    assert!(duration >= 1.0 + N as f64, "{page}");
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_carry_model_route_status_and_worker_and_clients_cannot_add_series() {
    let (a, _b, r) = two_models().await;
    let body = |model: &str| {
        Full::new(Bytes::from(
            json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                .to_string(),
        ))
    };
    let reply = send(
        post(r.addr, "/v1/chat/completions")
            .body(body("model-a"))
            .unwrap(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let worker = reply.worker();
    assert!(worker.starts_with(&a.url()), "{worker}");
    let page = scrape(&r).await;
    let series = format!(
        "rankgate_requests_total{{model=\"model-a\",route=\"/v1/chat/completions\",status=\"200\",worker=\"{worker}\"}}"
    );
    assert_eq!(sample(&page, &series), Some(1.0), "{page}");
    let before = page.lines().filter(|l| !l.starts_with('#')).count();

    // A thousand model names the fleet does not serve, and a hundred paths it does not route.
    let sent = AtomicUsize::new(0);
    let tasks = (0..10).map(|t| {
        let (addr, sent) = (r.addr, &sent);
        async move {
            for i in 0..100 {
                let name = format!("bogus-{t}-{i}");
                let reply = send(
                    post(addr, "/v1/chat/completions")
                        .body(body(&name))
                        .unwrap(),
                )
                .await;
                assert_eq!(reply.status, StatusCode::NOT_FOUND);
                if i % 10 == 0 {
                    assert_eq!(
                        get(addr, &format!("/v1/{name}")).await.status,
                        StatusCode::NOT_FOUND
                    );
                }
                sent.fetch_add(1, Relaxed);
            }
        }
    });
    futures_join_all(tasks).await;
    assert_eq!(sent.load(Relaxed), 1000);
    let page = scrape(&r).await;
    check_exposition(&page);
    assert!(
        !page.contains("bogus"),
        "a client's name became a label:\n{page}"
    );
    let after = page.lines().filter(|l| !l.starts_with('#')).count();
    // Two new series (the unknown model on its route, the unmatched path); the histograms'
    // `unknown` model was already there.
    assert!(after <= before + 2, "{before} -> {after} series:\n{page}");
    let local = |route: &str| {
        sample(
            &page,
            &format!("rankgate_local_responses_total{{model=\"unknown\",route=\"{route}\",status=\"404\"}}"),
        )
    };
    assert_eq!(local("/v1/chat/completions"), Some(1000.0), "{page}");
    assert_eq!(local("unmatched"), Some(100.0), "{page}");
    r.shutdown().await;
}

/// Runs the futures concurrently on this task, to their end.
async fn futures_join_all<F: std::future::Future<Output = ()>>(futs: impl Iterator<Item = F>) {
    let mut set: Vec<std::pin::Pin<Box<F>>> = futs.map(Box::pin).collect();
    std::future::poll_fn(|cx| {
        set.retain_mut(|f| f.as_mut().poll(cx).is_pending());
        if set.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await
}

const TOKEN: &str = "metrics-test-admin-token";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_engines_series_leave_the_page() {
    let a = engine(SimConfig::default()).await;
    let b = engine(SimConfig {
        start_rank: 2,
        ..SimConfig::default()
    })
    .await;
    let var = format!("RANKGATE_METRICS_TEST_ADMIN_TOKEN_{}", std::process::id());
    std::env::set_var(&var, TOKEN);
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\nadmin_token_env = \"{var}\"\n{FAST}{}{}",
        engine_toml(&a.url(), "vllm", 2, 0),
        engine_toml(&b.url(), "vllm", 2, 2),
    );
    let r = Router::start(Config::from_str(&text).unwrap())
        .await
        .unwrap();
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    // Traffic on every rank, so each has request series.
    a.set_kv_usage(vec![0.9, 0.9]);
    b.set_kv_usage(vec![0.1, 0.1]);
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows[0]["kv_usage"] == json!(0.9)
    })
    .await;
    for _ in 0..4 {
        assert_eq!(chat(r.addr, 1).await.status, StatusCode::OK);
    }
    let page = scrape(&r).await;
    assert!(sum(&page, "rankgate_requests_total", &[("status", "200")]) >= 4.0);
    assert!(
        page.contains(&format!("worker=\"{}@2\"", b.url())),
        "{page}"
    );
    assert!(page.contains(&format!("engine=\"{}\"", b.url())), "{page}");

    let req = Request::builder()
        .method(Method::DELETE)
        .uri(format!("http://{}/engines?url={}", r.admin_addr, b.url()))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let reply = send(req).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.json()["removed"], json!([b.url()]));
    wait_workers(&r, Duration::from_secs(10), |rows| rows.len() == 2).await;
    let page = scrape(&r).await;
    check_exposition(&page);
    assert!(!page.contains(&b.url()), "{page}");
    assert!(page.contains(&format!("rankgate_worker_info{{worker=\"{}@0\"", a.url())));
    assert_eq!(
        sample(&page, "rankgate_fleet_ranks{state=\"available\"}"),
        Some(2.0)
    );
    r.shutdown().await;
}
