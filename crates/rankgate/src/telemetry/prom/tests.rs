//! The reader and the projection against real captures, bad lines and fresh ranks.

use super::*;
use proptest::prelude::*;

fn engine(dp: u32, start: u32) -> Engine {
    crate::worker::test_engine("http://e:1", dp, start)
}

fn load(t: &RankTelemetry) -> &Load {
    match t {
        RankTelemetry::Available(l) => l,
        other => panic!("expected available, got {other:?}"),
    }
}

const IDLE: &str = include_str!("../../../../../tests/fixtures/vllm-0.32-dp2-metrics.txt");
const BUSY: &str =
    include_str!("../../../../../tests/fixtures/vllm-0.32-dp2-metrics-under-load.txt");

#[test]
fn real_vllm_capture_splits_per_engine_label() {
    let s = parse(BUSY);
    assert_eq!(s.bad_lines, 0);
    assert_eq!(s.per_rank.len(), 2);
    let now = Instant::now();
    let ranks = project(&s, &engine(2, 0), now);
    for t in &ranks {
        let l = load(t);
        assert!((l.kv_usage - 0.22580645161290325).abs() < 1e-12);
        assert_eq!(l.running, Some(7));
        assert_eq!(l.waiting, Some(0));
        assert_eq!(l.capacity_tokens, Some(4096));
        assert!(!l.aggregate);
    }
    // Each rank's own prefix-cache counters (rank 0 was sent more prompt tokens).
    let counters = |r: usize| load(&ranks[r]).prefix_cache;
    assert_eq!(
        counters(0),
        Some(PrefixCounters {
            queries: 860,
            hits: 0
        })
    );
    assert_eq!(
        counters(1),
        Some(PrefixCounters {
            queries: 51,
            hits: 0
        })
    );
    let idle = project(&parse(IDLE), &engine(2, 0), now);
    assert_eq!(load(&idle[0]).running, Some(0));
}

#[test]
fn prefix_counters_that_make_no_sense_are_left_out_not_the_load() {
    for (q, h) in [("10", "11"), ("-1", "0"), ("NaN", "0"), ("5", "+Inf")] {
        let text = format!(
            "vllm:kv_cache_usage_perc{{engine=\"0\"}} 0.5\nvllm:prefix_cache_queries_total{{engine=\"0\"}} {q}\nvllm:prefix_cache_hits_total{{engine=\"0\"}} {h}\n"
        );
        let ranks = project(&parse(&text), &engine(1, 0), Instant::now());
        let l = load(&ranks[0]);
        assert_eq!((l.kv_usage, l.prefix_cache), (0.5, None), "{q} {h}");
    }
}

#[test]
fn rank_outside_labels_is_unavailable_not_rank_zero() {
    let ranks = project(&parse(BUSY), &engine(2, 4), Instant::now());
    for t in ranks {
        assert!(
            matches!(t, RankTelemetry::Unavailable { ref reason } if reason.to_string().contains("no series"))
        );
    }
}

#[test]
fn one_bad_line_does_not_void_the_scrape() {
    let text = "vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\nvllm:kv_cache_usage_perc{engine=\"1\" 0.7\nvllm:num_requests_running{engine=\"1\"} 3\n";
    let s = parse(text);
    assert_eq!(s.bad_lines, 1);
    let ranks = project(&s, &engine(2, 0), Instant::now());
    assert_eq!(load(&ranks[0]).kv_usage, 0.5);
    assert!(
        matches!(&ranks[1], RankTelemetry::Unavailable { reason } if reason.to_string().contains("absent"))
    );
}

#[test]
fn invalid_values_make_only_that_rank_unavailable() {
    let text = "vllm:kv_cache_usage_perc{engine=\"0\"} NaN\nvllm:kv_cache_usage_perc{engine=\"1\"} 0.2\nvllm:kv_cache_usage_perc{engine=\"2\"} 1.5\nvllm:kv_cache_usage_perc{engine=\"3\"} 0.1\nvllm:num_requests_running{engine=\"3\"} -1\n";
    let ranks = project(&parse(text), &engine(4, 0), Instant::now());
    assert!(
        matches!(&ranks[0], RankTelemetry::Unavailable { reason } if reason.to_string().contains("NaN"))
    );
    assert_eq!(load(&ranks[1]).kv_usage, 0.2);
    assert!(
        matches!(&ranks[2], RankTelemetry::Unavailable { reason } if reason.to_string().contains("1.5"))
    );
    assert!(
        matches!(&ranks[3], RankTelemetry::Unavailable { reason } if reason.to_string().contains("running"))
    );
}

#[test]
fn a_rank_named_without_gauges_is_fresh_and_its_counters_say_whether_idle() {
    // Real vLLM with DP: a rank that has served nothing has its counters, not its gauges.
    let text = "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.3\n\
        vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 1\n\
        vllm:request_success_total{engine=\"0\",finished_reason=\"stop\",model_name=\"m\"} 7.0\n\
        vllm:request_success_total{engine=\"1\",finished_reason=\"stop\",model_name=\"m\"} 0.0\n\
        vllm:request_success_total{engine=\"1\",finished_reason=\"length\",model_name=\"m\"} 0.0\n\
        vllm:prompt_tokens_total{engine=\"1\",model_name=\"m\"} 0.0\n\
        vllm:request_success_total{engine=\"2\",finished_reason=\"stop\",model_name=\"m\"} 3.0\n\
        vllm:prefix_cache_queries_total{engine=\"3\",model_name=\"m\"} 0.0\n";
    let ranks = project(&parse(text), &engine(5, 0), Instant::now());
    assert_eq!(
        (load(&ranks[0]).kv_usage, load(&ranks[0]).fresh),
        (0.3, None)
    );
    assert_eq!(load(&ranks[1]).fresh, Some(Fresh::Idle));
    assert_eq!(load(&ranks[1]).running, None, "zeros are not a reading");
    // Counters that moved, or none at all: nothing proves it idle.
    assert_eq!(load(&ranks[2]).fresh, Some(Fresh::Unproven));
    assert_eq!(load(&ranks[3]).fresh, Some(Fresh::Unproven));
    // No series at all, and the engine did not report its size itself: unknown.
    assert!(matches!(
        &ranks[4],
        RankTelemetry::Unavailable {
            reason: Reason::Absent { rank: 4, .. }
        }
    ));
}

#[test]
fn a_rank_the_engine_says_it_has_is_fresh_while_its_series_are_missing() {
    let mut e = engine(2, 0);
    e.reported = Some(crate::worker::Reported {
        flavor: crate::worker::Flavor::Vllm,
        dp_size: Some(2),
        from: "test",
        at_least: false,
    });
    let text = "vllm:kv_cache_usage_perc{engine=\"0\"} 0.1\n";
    let ranks = project(&parse(text), &e, Instant::now());
    assert_eq!(load(&ranks[1]).fresh, Some(Fresh::Unproven));
    // Counted from /metrics labels, the size names nothing the labels do not.
    e.reported.as_mut().unwrap().at_least = true;
    let ranks = project(&parse(text), &e, Instant::now());
    assert!(matches!(&ranks[1], RankTelemetry::Unavailable { .. }));
}

#[test]
fn unlabelled_engine_figure_is_marked_aggregate() {
    let text =
        "sglang:token_usage{model_name=\"m\"} 0.4\nsglang:num_running_reqs{model_name=\"m\"} 2\n";
    let ranks = project(&parse(text), &engine(2, 0), Instant::now());
    assert!(ranks
        .iter()
        .all(|t| load(t).aggregate && load(t).kv_usage == 0.4));
}

#[test]
fn sglang_dp_rank_label_and_escapes() {
    let text = "sglang_token_usage{dp_rank=\"5\",model_name=\"a \\\"q\\\" b\"} 0.3 1700000000\n";
    let ranks = project(&parse(text), &engine(2, 4), Instant::now());
    assert!(matches!(ranks[0], RankTelemetry::Unavailable { .. }));
    assert_eq!(load(&ranks[1]).kv_usage, 0.3);
}

#[test]
fn external_lb_single_rank_keyed_by_endpoint() {
    let text = "vllm:kv_cache_usage_perc{engine=\"0\"} 0.6\n";
    let ranks = project(&parse(text), &engine(1, 3), Instant::now());
    assert_eq!(load(&ranks[0]).kv_usage, 0.6);
}

proptest! {
    #[test]
    fn parser_never_panics(text in "\\PC{0,300}") {
        let _ = parse(&text);
    }

    #[test]
    fn written_values_read_back(values in proptest::collection::vec(0.0f64..=1.0, 1..8)) {
        let mut text = String::from("# HELP x\n");
        for (i, v) in values.iter().enumerate() {
            text.push_str(&format!("vllm:kv_cache_usage_perc{{engine=\"{i}\",model_name=\"m\"}} {v}\n"));
        }
        let ranks = project(&parse(&text), &engine(values.len() as u32, 0), Instant::now());
        for (t, v) in ranks.iter().zip(&values) {
            prop_assert_eq!(load(t).kv_usage, *v);
        }
    }
}
