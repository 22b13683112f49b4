//! Telemetry late: a loaded engine's `/metrics` can take seconds to answer. Its ranks go stale
//! while they still answer, and the pick falls back to this router's own requests in flight;
//! the queue judges the same way (`flow.max_running` less those), rather than letting all that
//! waits through into the engine's queue.

use super::*;

#[tokio::test]
async fn a_busy_rank_whose_telemetry_is_late_still_holds_the_queue() {
    let e = engine(slow()).await;
    // Stale 300 ms after the last answer, while a poll may hang for 30 s before it counts as
    // failed (the rank stays reachable meanwhile).
    let telemetry =
        "[telemetry]\ninterval = \"50ms\"\nstale_after = \"300ms\"\ntimeout = \"30s\"\n";
    let r = router_with(
        "",
        &format!("{telemetry}{FLOW}"),
        &[engine_toml(&e.url(), "vllm", 1, 0)],
    )
    .await;
    wait_state(&r, &[0], "available").await;
    let blocker = busy(&r, 20).await;
    e.set_hang_metrics(true);
    wait_workers(&r, Duration::from_secs(5), |rows| {
        rows[0]["telemetry"] != "available"
    })
    .await;
    let second = ask(&r, "second", &[], 1);
    // Held: the rank's one seat is this router's blocker's.
    waiting(&r, 1).await;
    assert!(
        !blocker.is_finished(),
        "the rank freed first: the test proves nothing"
    );
    assert_eq!(arrivals(&e), ["blocker"]);
    // Sent when the blocker ends, its telemetry still late.
    assert_eq!(blocker.await.unwrap().status, 200);
    let second = second.await.unwrap();
    assert_eq!(
        second.status,
        200,
        "{}",
        String::from_utf8_lossy(&second.body)
    );
    assert_eq!(arrivals(&e), ["blocker", "second"]);
    let rows = wait_workers(&r, Duration::from_secs(1), |_| true).await;
    assert_ne!(rows[0]["telemetry"], "available", "{rows:?}");
    e.set_hang_metrics(false);
}
