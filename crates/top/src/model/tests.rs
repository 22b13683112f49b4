use super::*;

fn row(id: &str, rank: u32, kv: Option<f64>, in_flight: u64) -> Row {
    let engine = id.rsplit_once('@').map_or(id, |(e, _)| e).to_string();
    Row {
        id: id.to_string(),
        engine,
        dp_rank: Some(rank),
        telemetry: if kv.is_some() {
            "available"
        } else {
            "unavailable"
        }
        .into(),
        reason_kind: kv.is_none().then(|| "stale".to_string()),
        kv_usage: kv,
        in_flight,
        ..Row::default()
    }
}

fn state(rows: Vec<Row>) -> State {
    let mut s = State::new("http://127.0.0.1:9", Duration::from_secs(1));
    s.rows = rows;
    s
}

fn ids(s: &State) -> Vec<String> {
    s.visible().iter().map(|r| r.id.clone()).collect()
}

#[test]
fn sorts_by_each_key_and_reverses() {
    let mut s = state(vec![
        row("http://b:1@10", 10, Some(0.2), 1),
        row("http://b:1@9", 9, None, 0),
        row("http://a:1@0", 0, Some(0.9), 4),
    ]);
    s.rows[0].req_per_s = Some(3.0);
    s.rows[2].req_per_s = Some(1.0);
    assert_eq!(ids(&s), ["http://a:1@0", "http://b:1@9", "http://b:1@10"]);
    s.sort = SortKey::Kv;
    assert_eq!(ids(&s), ["http://a:1@0", "http://b:1@10", "http://b:1@9"]);
    s.sort = SortKey::InFlight;
    assert_eq!(ids(&s), ["http://a:1@0", "http://b:1@10", "http://b:1@9"]);
    s.sort = SortKey::ReqPerSec;
    assert_eq!(ids(&s), ["http://b:1@10", "http://a:1@0", "http://b:1@9"]);
    s.sort = SortKey::State;
    assert_eq!(ids(&s), ["http://b:1@9", "http://a:1@0", "http://b:1@10"]);
    s.reversed = true;
    assert_eq!(ids(&s), ["http://b:1@10", "http://a:1@0", "http://b:1@9"]);
}

#[test]
fn sort_keys_cycle_both_ways() {
    let mut k = SortKey::Id;
    let mut seen = Vec::new();
    for _ in 0..SortKey::ALL.len() {
        seen.push(k);
        assert_eq!(k.next().prev(), k);
        k = k.next();
    }
    assert_eq!(k, SortKey::Id);
    assert_eq!(seen, SortKey::ALL);
}

#[test]
fn filter_matches_engine_or_model_ignoring_case() {
    let mut a = row("http://10.0.0.1:8000@0", 0, Some(0.1), 0);
    a.models = vec!["meta-llama/Llama-3-8B".into()];
    let mut b = row("http://10.0.0.2:8000@1", 1, Some(0.1), 0);
    b.models = vec!["Qwen/Qwen2-7B".into()];
    let mut s = state(vec![a, b]);
    s.filter = "llama".into();
    assert_eq!(ids(&s), ["http://10.0.0.1:8000@0"]);
    s.filter = "10.0.0.2".into();
    assert_eq!(ids(&s), ["http://10.0.0.2:8000@1"]);
    s.filter = " QWEN ".into();
    assert_eq!(ids(&s), ["http://10.0.0.2:8000@1"]);
    s.filter = "nothing".into();
    assert!(ids(&s).is_empty());
    s.filter.clear();
    assert_eq!(ids(&s).len(), 2);
    // Totals stay the fleet's whatever the filter.
    s.filter = "nothing".into();
    assert_eq!(s.totals().total, 2);
}

#[test]
fn polls_fill_rates_and_vanished_ranks_go() {
    let t0 = Instant::now();
    let mut s = State::new("http://x", Duration::from_secs(1));
    let doc = |ids: &[&str]| {
        serde_json::to_vec(&ids.iter().map(|i| serde_json::json!({"id": i, "telemetry": "available", "kv_usage": 0.5, "in_flight": 1})).collect::<Vec<_>>()).unwrap()
    };
    let metrics = |n: u32| {
        format!("rankgate_requests_total{{worker=\"a\",status=\"2xx\"}} {n}\nrankgate_requests_total{{worker=\"b\",status=\"2xx\"}} {n}\n")
    };
    s.apply(t0, &doc(&["a", "b"]), Ok(&metrics(0))).unwrap();
    assert_eq!(s.totals().req_per_s, None);
    s.apply(
        t0 + Duration::from_secs(1),
        &doc(&["a", "b"]),
        Ok(&metrics(3)),
    )
    .unwrap();
    assert_eq!(s.rows()[0].req_per_s, Some(3.0));
    let t = s.totals();
    assert_eq!((t.available, t.total, t.in_flight), (2, 2, 2));
    assert_eq!((t.mean_kv, t.req_per_s), (Some(0.5), Some(6.0)));
    // b left the fleet: its row goes, nothing else happens.
    s.apply(t0 + Duration::from_secs(2), &doc(&["a"]), Ok(&metrics(3)))
        .unwrap();
    assert_eq!(ids(&s), ["a"]);
    assert_eq!(s.rows()[0].req_per_s, Some(0.0));
    // The admin went away: the rows stay, stale; failures are counted.
    s.failed("connection refused".into());
    s.failed("connection refused".into());
    assert!(s.stale());
    assert_eq!(s.outage.as_ref().unwrap().failures, 2);
    assert_eq!(ids(&s), ["a"]);
    // Garbage is an outage too, and keeps the rows.
    assert!(s.apply(t0, b"<html>", Ok("")).is_err());
    assert_eq!(s.outage.as_ref().unwrap().failures, 3);
    assert_eq!(ids(&s), ["a"]);
    // Back: fresh again; /metrics failing only loses the rates.
    s.apply(
        t0 + Duration::from_secs(3),
        &doc(&["a"]),
        Err("HTTP 500".into()),
    )
    .unwrap();
    assert!(!s.stale());
    assert_eq!(s.rows()[0].req_per_s, None);
    assert_eq!(s.metrics_error.as_deref(), Some("HTTP 500"));
}

#[test]
fn rows_read_leniently() {
    let doc =
        br#"[{"id":"http://h:1@0","engine":"http://h:1","dp_rank":0,"telemetry":"unavailable",
        "reason":"stale","reason_kind":"stale","kv_usage":null,"some_new_field":[1,2]},{}]"#;
    let rows: Vec<Row> = serde_json::from_slice(doc).unwrap();
    assert_eq!(rows[0].state(), "stale");
    assert_eq!(rows[0].kv_usage, None);
    assert_eq!(rows[1].state(), "down");
}

#[test]
fn scrolling_stays_within_the_rows() {
    let mut s = state(
        (0..10)
            .map(|i| row(&format!("http://h:1@{i}"), i, Some(0.1), 0))
            .collect(),
    );
    s.scroll_by(-3, 4);
    assert_eq!(s.scroll, 0);
    s.scroll_by(100, 4);
    assert_eq!(s.scroll, 6);
    s.scroll_by(-2, 4);
    assert_eq!(s.scroll, 4);
}

#[test]
fn ids_truncate_keeping_port_and_rank() {
    assert_eq!(short_id("http://127.0.0.1:8000@3", 24), "127.0.0.1:8000@3");
    assert_eq!(
        short_id("http://vllm-0.vllm.inference.svc.cluster.local:8000@3", 24),
        "vllm-0.vllm.infe…:8000@3"
    );
    // A path goes before the host is cut.
    assert_eq!(
        short_id("http://gpu-node-7:8000/prefix/v1@12", 24),
        "gpu-node-7…:8000@12"
    );
    // No rank, no port: the host is cut at the end.
    assert_eq!(
        short_id("https://a-very-long-gateway-name.example.com", 16),
        "a-very-long-gat…"
    );
    // IPv6 keeps its port.
    assert_eq!(
        short_id("http://[2001:db8::1234:5678]:8000@1", 16),
        "[2001:db…:8000@1"
    );
    // Too narrow for host and tail: the end of it all.
    assert_eq!(short_id("http://host:8000@1", 6), "…000@1");
    assert_eq!(short_id("http://host:8000@1", 0), "");
    for w in 0..30 {
        assert!(
            short_id("http://some.long.host.name:65535/x@123", w)
                .chars()
                .count()
                <= w
        );
    }
}

#[test]
fn truncate_marks_the_cut() {
    assert_eq!(truncate("abcdef", 6), "abcdef");
    assert_eq!(truncate("abcdef", 4), "abc…");
    assert_eq!(truncate("abcdef", 0), "");
}

#[test]
fn a_fresh_rank_is_routable_and_says_so() {
    let fresh = Row {
        telemetry: "fresh".into(),
        ..row("http://h:1@1", 1, None, 0)
    };
    let s = state(vec![row("http://h:1@0", 0, Some(0.2), 1), fresh.clone()]);
    assert_eq!((fresh.state(), fresh.available()), ("fresh", true));
    assert_eq!(s.totals().available, 2);
}

#[test]
fn the_fail_cell_names_the_run_of_failures() {
    let mut r = row("http://e:1@0", 0, Some(0.1), 0);
    assert_eq!(r.fail_cell(), None, "no failures: no cell");
    r.consecutive_failures = 5;
    assert_eq!(
        r.fail_cell().as_deref(),
        Some("5"),
        "an older router: the count alone"
    );
    for (kind, shown) in [
        ("500", "5 500"),
        ("hung", "5 hung"),
        ("transport", "5 conn"),
        ("timeout", "5 tmo"),
        ("mixed", "5 mix"),
    ] {
        r.failures = Some(Failures {
            kind: Some(kind.into()),
            ..Failures::default()
        });
        assert_eq!(r.fail_cell().as_deref(), Some(shown));
    }
}
