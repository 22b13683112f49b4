//! `rankgate demo`: the scenario in `configs/scenarios/demo.toml`, built into the binary, run
//! once per policy with the load client, and printed side by side.
//!
//! Two independent vLLM servers of two DP ranks each (`--data-parallel-size 2`, ranks @0 and @1
//! on each). The first server's rank 0 is already 85% full with someone else's work, so requests
//! sent there queue for KV; the second server's rank 1 publishes no telemetry at all. A router
//! that reads per-rank KV keeps traffic off the full rank and never sends anything to the rank it
//! knows nothing about; a round-robin router gives each rank a quarter of the traffic.
//!
//! Then, in a second or two, a disaggregated pair (`pd`): which prefill rank and which decode
//! rank each request's two legs went to.

mod pd;

use crate::scenario::{self, render, Scenario};

const DEMO: &str = include_str!("../../../../configs/scenarios/demo.toml");

/// The demo's scenario, with the request count and rate optionally overridden.
pub fn scenario(requests: Option<usize>, rate: Option<f64>) -> Result<Scenario, String> {
    let mut s = Scenario::parse(DEMO, None)?;
    if let Some(n) = requests {
        s.workload.requests = Some(n);
    }
    if rate.is_some() {
        s.workload.rate = rate;
    }
    Ok(s)
}

/// Runs every policy of the demo and prints the comparison.
pub async fn run(s: Scenario) -> Result<(), String> {
    println!(
        "rankgate demo: 2 independent simulated vLLM servers x 2 DP ranks; {} streaming requests at {}/s per policy",
        s.workload.requests.unwrap_or_default(),
        s.workload.rate.unwrap_or_default()
    );
    let runs = scenario::run(&s, None, true).await?;
    println!("\n{}", render::markdown(&s, &runs));
    println!("(times in ms; TTFT = first streamed token; ranks in fleet order: rank 0 is the first server's @0, 85% full at the start; rank 3 the second server's @1, which publishes no telemetry)");
    if let [a, b, ..] = runs.as_slice() {
        let (x, y) = (a.report.ttft().p99, b.report.ttft().p99);
        println!(
            "TTFT p99: {} {x:.0} ms vs {} {y:.0} ms ({:.1}x)",
            a.policy.as_str(),
            b.policy.as_str(),
            y / x.max(1e-9)
        );
    }
    pd::run().await
}
