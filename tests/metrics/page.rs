//! The whole page during traffic: valid Prometheus text with every family rankgate documents, and
//! accepted by promtool (ignored without promtool).

use http::StatusCode;
use http_body_util::BodyExt;

use crate::common::*;
use crate::{exposition::*, helpers::*};

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
