//! A simulated vLLM rank's queue over real sockets, as vLLM's scheduler keeps it: at most
//! `max_num_seqs` requests run and the rest show as waiting in `/metrics`; waiting requests start
//! in arrival order, so a small request behind a large one that does not fit waits for it (FCFS);
//! under the priority policy a better `priority` goes ahead of those queued, and under FCFS a
//! `priority` is refused. Each request is a stream held open until the test drops it.

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use rankgate_sim::sim::{SchedulingPolicy, SimConfig, SimEngine, SimFlavor};
use serde_json::json;

use crate::common::{client, engine, get, post, post_json, sim};

const WAIT: Duration = Duration::from_secs(10);

/// One vLLM rank of 1,000 tokens decoding slowly (20 tokens/s), so that a stream holds its KV
/// until it is dropped.
fn one_rank(max_num_seqs: u32, scheduling_policy: SchedulingPolicy) -> SimConfig {
    SimConfig {
        capacity_tokens: 1000,
        decode_tokens_per_sec: 20.0,
        max_num_seqs,
        scheduling_policy,
        ..sim(SimFlavor::Vllm, 1, 0)
    }
}

/// Opens a streaming chat completion of `max_tokens` (the prompt is about 10 tokens) at
/// `priority`, and waits until the rank counts it (running or waiting): arrivals are ordered.
async fn open(e: &SimEngine, max_tokens: u64, priority: Option<i64>) -> http::Response<Incoming> {
    let before = gauges(e).await;
    let mut body = json!({"messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": max_tokens, "stream": true});
    if let Some(p) = priority {
        body["priority"] = json!(p);
    }
    let req = post(e.addr, "/v1/chat/completions").body(Full::new(Bytes::from(body.to_string())));
    let resp = client().request(req.unwrap()).await.expect("stream opened");
    assert_eq!(resp.status(), StatusCode::OK);
    until_gauges(e, |(r, w)| r + w == before.0 + before.1 + 1).await;
    resp
}

/// The rank's `vllm:num_requests_running` and `vllm:num_requests_waiting` from `/metrics`.
async fn gauges(e: &SimEngine) -> (u64, u64) {
    let page = String::from_utf8(get(e.addr, "/metrics").await.body.to_vec()).expect("text");
    let value = |name: &str| -> u64 {
        let line = page.lines().find(|l| l.starts_with(&format!("{name}{{")));
        let v = line.and_then(|l| l.rsplit(' ').next()).unwrap_or("");
        v.parse::<f64>()
            .unwrap_or_else(|_| panic!("{name} in\n{page}")) as u64
    };
    (
        value("vllm:num_requests_running"),
        value("vllm:num_requests_waiting"),
    )
}

/// Polls `/metrics` until the (running, waiting) gauges satisfy `want`, at most [`WAIT`].
async fn until_gauges(e: &SimEngine, want: impl Fn((u64, u64)) -> bool) -> (u64, u64) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let g = gauges(e).await;
        if want(g) {
            return g;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "gauges stuck at {g:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits for the stream's first token: its request is running.
async fn first_token(resp: &mut http::Response<Incoming>) {
    let frame = tokio::time::timeout(WAIT, resp.body_mut().frame()).await;
    let frame = frame.expect("a token within 10 s").expect("a frame");
    assert!(frame.expect("no error").is_data());
}

#[tokio::test]
async fn max_num_seqs_caps_running_requests_and_the_rest_show_as_waiting() {
    let e = engine(one_rank(2, SchedulingPolicy::Fcfs)).await;
    let mut streams = Vec::new();
    for _ in 0..4 {
        streams.push(open(&e, 100, None).await);
    }
    // KV is plenty (4 x 110 of 1,000 tokens): the cap alone holds the third and fourth back.
    assert_eq!(until_gauges(&e, |g| g == (2, 2)).await, (2, 2));
    // The first one ends: the third starts, the fourth still waits.
    drop(streams.remove(0));
    until_gauges(&e, |g| g == (2, 1)).await;
    first_token(&mut streams[1]).await;
    drop(streams);
    until_gauges(&e, |g| g == (0, 0)).await;
}

#[tokio::test]
async fn a_small_request_behind_a_large_one_that_does_not_fit_waits_for_it() {
    let e = engine(one_rank(8, SchedulingPolicy::Fcfs)).await;
    let running = open(&e, 600, None).await;
    until_gauges(&e, |g| g == (1, 0)).await;
    // 610 + 510 > 1,000 tokens: the large one waits, and the small one (610 + 60 would fit)
    // waits behind it.
    let mut large = open(&e, 500, None).await;
    let mut small = open(&e, 50, None).await;
    assert_eq!(gauges(&e).await, (1, 2));
    drop(running);
    until_gauges(&e, |g| g == (2, 0)).await;
    first_token(&mut large).await;
    first_token(&mut small).await;
}

#[tokio::test]
async fn under_priority_a_better_request_overtakes_the_queue_and_fcfs_refuses_one() {
    let e = engine(one_rank(1, SchedulingPolicy::Priority)).await;
    let running = open(&e, 100, Some(0)).await;
    let _first = open(&e, 100, Some(0)).await;
    let _second = open(&e, 100, Some(3)).await;
    let mut urgent = open(&e, 100, Some(-5)).await;
    assert_eq!(gauges(&e).await, (1, 3));
    drop(running);
    // One runs at a time: the urgent one, though it came last.
    first_token(&mut urgent).await;
    assert_eq!(gauges(&e).await, (1, 2));

    // vLLM under FCFS refuses a priority other than 0.
    let fcfs = engine(one_rank(8, SchedulingPolicy::Fcfs)).await;
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "priority": 2});
    let r = post_json(fcfs.addr, "/v1/chat/completions", body).await;
    let v = r.assert_openai_error(400, Some("BadRequestError"));
    assert_eq!(v["error"]["param"], "priority");
    let zero = json!({"prompt": "hi", "max_tokens": 1, "priority": 0});
    assert_eq!(
        post_json(fcfs.addr, "/v1/completions", zero).await.status,
        200
    );
}
