use super::kv_estimate::estimate_kv_per_request;
use super::*;
use crate::table::Load;
use tokio::time::Instant;

fn view(kv: f64, running: u32, capacity: Option<u64>) -> RankView {
    RankView {
        telemetry: RankTelemetry::Available(Load {
            kv_usage: kv,
            running: Some(running),
            waiting: Some(0),
            used_tokens: None,
            capacity_tokens: capacity,
            aggregate: false,
            upstream: None,
            prefix_cache: None,
            fresh: None,
            sampled_at: Instant::now(),
        }),
        ..RankView::initial()
    }
}

#[test]
fn credit_is_relative_to_each_ranks_capacity() {
    // Idle fleet: the default is scaled so the half-size rank fills twice as fast.
    let mut v = vec![view(0.0, 0, Some(4096)), view(0.0, 0, Some(2048))];
    estimate_kv_per_request(&mut v, 0.02);
    assert!((v[0].kv_per_request - 0.015).abs() < 1e-12);
    assert!((v[1].kv_per_request - 0.03).abs() < 1e-12);
    // Rank 0 runs 4 requests at 0.1 KV: ~102 tokens each; rank 1 (idle, 1024 tokens) would
    // take 0.1 per request, rank 2 (no capacity known) the fleet fraction 0.025.
    let mut v = vec![
        view(0.1, 4, Some(4096)),
        view(0.0, 0, Some(1024)),
        view(0.0, 0, None),
    ];
    estimate_kv_per_request(&mut v, 0.02);
    assert!((v[0].kv_per_request - 0.025).abs() < 1e-12);
    assert!((v[1].kv_per_request - 0.1).abs() < 1e-12);
    assert!((v[2].kv_per_request - 0.025).abs() < 1e-12);
}
