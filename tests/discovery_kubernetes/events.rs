//! What the discovery task makes of the API server's answers: the first list gives the ready pods
//! at their named port, watch events move pods in and out, an expired watch lists again, a failing
//! API server keeps the last set, and a pod with a bad annotation is skipped.

use rankgate::discovery::kubernetes::{DP_SIZE_ANNOTATION, START_RANK_ANNOTATION};
use serde_json::{json, Value};

use crate::{fake_api::*, helpers::*};

fn annotated(mut pod: Value, key: &str, value: &str) -> Value {
    pod["metadata"]["annotations"][key] = json!(value);
    pod
}

#[tokio::test]
async fn the_first_list_gives_the_ready_pods_at_their_named_port() {
    let api = FakeApi::start(vec![
        annotated(pod("vllm-0", "127.0.0.10", true), DP_SIZE_ANNOTATION, "4"),
        pod("vllm-1", "127.0.0.11", false),
    ])
    .await;
    let mut w = start(&api);
    let set = w.next_engines().await;
    assert_eq!(set.len(), 1, "{set:?}");
    assert_eq!(&*set[0].url, "http://127.0.0.10:8000");
    assert_eq!((set[0].dp_size, set[0].start_rank), (4, 0));
    // A change the watch carries (the set is sent before the watch is asked for).
    api.apply(pod("vllm-1", "127.0.0.11", true));
    assert_eq!(w.next().await.len(), 2);
    // What kube asked: a page of the list by selector, then a watch from the list's
    // resourceVersion (the fake's 102 after its two pods).
    let requests = api.requests();
    eprintln!("requests: {requests:?}");
    let list = &requests[0];
    assert!(list.contains("labelSelector=app%3Dvllm") && list.contains("limit=500"));
    let watch = &requests[1];
    assert!(watch.contains("watch=true") && watch.contains("resourceVersion=102"));
}

#[tokio::test]
async fn watch_events_move_pods_in_and_out() {
    let api = FakeApi::start(vec![]).await;
    let mut w = start(&api);
    assert_eq!(
        w.next().await,
        Vec::<String>::new(),
        "an empty fleet is sent"
    );
    api.apply(pod("vllm-0", "127.0.0.10", false));
    api.apply(pod("vllm-0", "127.0.0.10", true));
    assert_eq!(w.next().await, ["http://127.0.0.10:8000"]);
    api.apply(pod("vllm-1", "127.0.0.11", true));
    assert_eq!(
        w.next().await,
        ["http://127.0.0.10:8000", "http://127.0.0.11:8000"]
    );
    api.apply(pod("vllm-0", "127.0.0.10", false));
    assert_eq!(w.next().await, ["http://127.0.0.11:8000"]);
    // Terminating: still Ready while it drains, but no longer given requests.
    let mut terminating = pod("vllm-1", "127.0.0.11", true);
    terminating["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
    api.apply(terminating);
    assert_eq!(w.next().await, Vec::<String>::new());
    api.apply(pod("vllm-2", "127.0.0.12", true));
    assert_eq!(w.next().await, ["http://127.0.0.12:8000"]);
    api.delete("vllm-2");
    assert_eq!(w.next().await, Vec::<String>::new());
    assert_eq!(api.lists(), 1, "events came by the watch, not by lists");
}

#[tokio::test]
async fn an_expired_watch_lists_again() {
    let api = FakeApi::start(vec![
        pod("vllm-0", "127.0.0.10", true),
        pod("vllm-1", "127.0.0.11", true),
    ])
    .await;
    let mut w = start(&api);
    assert_eq!(
        w.next().await,
        ["http://127.0.0.10:8000", "http://127.0.0.11:8000"]
    );
    // The API server says 410 on the open stream; meanwhile vllm-0 went and vllm-2 came.
    api.expire(Expiry::InStream, |pods| {
        pods.remove("vllm-0");
        pods.insert("vllm-2".into(), pod("vllm-2", "127.0.0.12", true));
    });
    assert_eq!(
        w.next().await,
        ["http://127.0.0.11:8000", "http://127.0.0.12:8000"]
    );
    assert_eq!(api.lists(), 2);
    // The stream ends and its resumption is refused with 410: listed again.
    api.expire(Expiry::OnResume, |pods| {
        pods.insert("vllm-1".into(), pod("vllm-1", "127.0.0.11", false));
        pods.insert("vllm-3".into(), pod("vllm-3", "127.0.0.13", true));
    });
    assert_eq!(
        w.next().await,
        ["http://127.0.0.12:8000", "http://127.0.0.13:8000"]
    );
    assert_eq!(api.lists(), 3);
    // And the new watch carries events.
    api.delete("vllm-3");
    assert_eq!(w.next().await, ["http://127.0.0.12:8000"]);
}

#[tokio::test]
async fn a_failing_api_server_keeps_the_last_set_until_it_answers() {
    let api = FakeApi::start(vec![pod("vllm-0", "127.0.0.10", true)]).await;
    let mut w = start(&api);
    assert_eq!(w.next().await, ["http://127.0.0.10:8000"]);
    api.state.lock().unwrap().failing_lists = 2;
    api.expire(Expiry::InStream, |pods| {
        pods.insert("vllm-1".into(), pod("vllm-1", "127.0.0.11", true));
    });
    // Nothing is sent while lists fail; the first list that works gives the new set.
    assert_eq!(
        w.next().await,
        ["http://127.0.0.10:8000", "http://127.0.0.11:8000"]
    );
    assert_eq!(api.state.lock().unwrap().failing_lists, 0);
}

#[tokio::test]
async fn a_pod_with_a_bad_annotation_is_skipped_and_the_others_kept() {
    let api = FakeApi::start(vec![
        pod("vllm-0", "127.0.0.10", true),
        annotated(
            pod("vllm-1", "127.0.0.11", true),
            DP_SIZE_ANNOTATION,
            "four",
        ),
    ])
    .await;
    let mut w = start(&api);
    assert_eq!(w.next().await, ["http://127.0.0.10:8000"]);
    api.apply(annotated(
        pod("vllm-2", "127.0.0.12", true),
        START_RANK_ANNOTATION,
        "-8",
    ));
    api.apply(pod("vllm-3", "127.0.0.13", true));
    assert_eq!(
        w.next().await,
        ["http://127.0.0.10:8000", "http://127.0.0.13:8000"]
    );
    // Fixed: it joins.
    api.apply(annotated(
        pod("vllm-1", "127.0.0.11", true),
        DP_SIZE_ANNOTATION,
        "4",
    ));
    let set = w.next_engines().await;
    assert_eq!(set.len(), 3);
    assert_eq!(
        (&*set[1].url, set[1].dp_size),
        ("http://127.0.0.11:8000", 4)
    );
}
