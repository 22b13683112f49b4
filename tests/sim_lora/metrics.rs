//! `vllm:lora_requests_info` in the shape vLLM 0.32 gives it (the same help, the same labels, no
//! `engine` label, the value the time of the last update, one series per label set seen, the
//! newest the current state, an adapter shown once a request of it runs), with DP the union over
//! ranks; and a request set aside for a slot counted as vLLM's `deferred` and as the sim's slot
//! wait.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use rankgate_sim::sim::{SimConfig, SimEngine};

use crate::common::{client, engine, get, post, post_json};
use crate::{chat_for, fixture, lora_engine};

const NAME: &str = "vllm:lora_requests_info";

/// One series of `name`: its labels in order, and its value.
type Series = (Vec<(String, String)>, f64);

/// The series of `name` in a `/metrics` page (label values may hold commas).
fn series(page: &str, name: &str) -> Vec<Series> {
    let prefix = format!("{name}{{");
    let mut out = Vec::new();
    for line in page.lines().filter(|l| l.starts_with(&prefix)) {
        let (labels, value) = line[prefix.len()..]
            .rsplit_once("} ")
            .expect("a series line");
        let mut pairs = Vec::new();
        let mut rest = labels;
        while let Some((key, after)) = rest.split_once("=\"") {
            let (value, tail) = after.split_once('"').expect("a quoted value");
            pairs.push((key.to_string(), value.to_string()));
            rest = tail.trim_start_matches(',');
        }
        out.push((pairs, value.parse().expect("a number")));
    }
    out
}

/// The label set of the newest series (the current state) and its `running_lora_adapters`.
fn newest(s: &[Series]) -> String {
    let top = s
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .expect("a series");
    let label = |k: &str| top.0.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(
        label("running_lora_adapters"),
        label("waiting_lora_adapters")
    );
    label("running_lora_adapters").unwrap_or_default()
}

async fn scrape(e: &SimEngine) -> String {
    String::from_utf8(get(e.addr, "/metrics").await.body.to_vec()).expect("text")
}

/// The value of the series of `name` whose labels include `has`.
fn value(page: &str, name: &str, has: &str) -> f64 {
    (series(page, name).into_iter())
        .find(|(l, _)| l.iter().any(|(k, v)| format!("{k}=\"{v}\"") == has))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("{name} with {has} in\n{page}"))
}

/// Opens a streaming chat for `model` pinned to rank `rank`, held until dropped, and waits
/// until the rank counts `running` running and `waiting` waiting.
async fn open(
    e: &SimEngine,
    model: &str,
    rank: u32,
    (running, waiting): (f64, f64),
) -> http::Response<Incoming> {
    let body = chat_for(model, 400, true).to_string();
    let req = post(e.addr, "/v1/chat/completions")
        .header("x-data-parallel-rank", rank.to_string())
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = client().request(req).await.expect("stream opened");
    assert_eq!(resp.status(), 200);
    let engine = format!("engine=\"{rank}\"");
    for _ in 0..500 {
        let page = scrape(e).await;
        let now = (
            value(&page, "vllm:num_requests_running", &engine),
            value(&page, "vllm:num_requests_waiting", &engine),
        );
        if now == (running, waiting) {
            return resp;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("rank {rank} never counted {running} running and {waiting} waiting");
}

/// Slow ranks (20 tokens a second), so that a stream holds its slot until it is dropped.
fn slow(dp: u32, max_loras: u32) -> SimConfig {
    SimConfig {
        decode_tokens_per_sec: 20.0,
        ..lora_engine(dp, max_loras, &["sql-lora", "chat-lora"], false)
    }
}

#[tokio::test]
async fn the_gauge_has_vllms_shape_and_its_newest_series_is_the_current_state() {
    let e = engine(slow(1, 1)).await;
    let lines = |page: &str| -> Vec<String> {
        (page.lines().filter(|l| l.contains("lora_requests_info")))
            .map(str::to_string)
            .collect()
    };
    let start = fixture("metrics-lora-start");
    assert_eq!(
        lines(&scrape(&e).await),
        lines(&start),
        "help and type, no series yet"
    );

    for model in ["tiny-llama", "sql-lora", "chat-lora"] {
        let r = post_json(e.addr, "/v1/chat/completions", chat_for(model, 2, false)).await;
        assert_eq!(r.status, 200);
    }
    let real = series(&fixture("metrics-lora-after-two"), NAME);
    let ours = series(&scrape(&e).await, NAME);
    let labels =
        |s: &[Series]| -> Vec<Vec<(String, String)>> { s.iter().map(|(l, _)| l.clone()).collect() };
    assert_eq!(
        labels(&ours),
        labels(&real),
        "the same series, in the same order"
    );
    assert!(
        ours.iter().all(|(_, t)| *t > 1.7e9),
        "unix seconds: {ours:?}"
    );
    assert_eq!(newest(&ours), newest(&real), "nothing runs: the empty set");

    // One slot: a chat-lora request waits aside while sql-lora runs, unseen by the gauge.
    let held = open(&e, "sql-lora", 0, (1.0, 0.0)).await;
    let aside = open(&e, "chat-lora", 0, (1.0, 1.0)).await;
    let page = scrape(&e).await;
    let competing = fixture("metrics-lora-competing");
    assert_eq!(newest(&series(&page, NAME)), "sql-lora");
    assert_eq!(
        newest(&series(&competing, NAME)),
        "sql-lora",
        "as vLLM showed it"
    );
    let by_reason = "vllm:num_requests_waiting_by_reason";
    assert_eq!(value(&page, by_reason, "reason=\"deferred\""), 1.0);
    assert_eq!(value(&page, by_reason, "reason=\"capacity\""), 0.0);
    let real_reasons: Vec<String> = (series(&competing, by_reason).into_iter())
        .flat_map(|(l, _)| l.into_iter().map(|(k, _)| k))
        .collect();
    assert!(real_reasons.contains(&"reason".to_string()));
    assert_eq!(
        value(&page, "sim_lora_slot_waits_total", "engine=\"0\""),
        1.0
    );
    assert_eq!(e.lora_slot_waits(), [1]);
    drop((held, aside));
    e.shutdown().await;
}

#[tokio::test]
async fn with_dp_the_labels_are_the_union_over_ranks_and_name_no_engine() {
    let e = engine(slow(2, 1)).await;
    let a = open(&e, "sql-lora", 0, (1.0, 0.0)).await;
    let b = open(&e, "chat-lora", 1, (1.0, 0.0)).await;
    let page = scrape(&e).await;
    let s = series(&page, NAME);
    assert_eq!(newest(&s), "sql-lora,chat-lora");
    assert!(s.iter().all(|(l, _)| l.iter().all(|(k, _)| k != "engine")));
    assert!(s
        .iter()
        .all(|(l, _)| l[0] == ("max_lora".into(), "1".into())));
    for rank in ["engine=\"0\"", "engine=\"1\""] {
        assert_eq!(value(&page, "sim_lora_slot_waits_total", rank), 0.0);
        assert_eq!(value(&page, "sim_lora_loads_total", rank), 1.0);
    }
    drop((a, b));
    e.shutdown().await;
}
