//! What prefix affinity costs on the request path, as ratios measured in one run: the pick over
//! 64 ranks with and without affinity, and reading a prompt's chunk names from the body (the
//! scan affinity adds) next to the `model` scan every multi-model request already pays.
//!
//! ```sh
//! cargo run --release --example pick_cost            # 5 rounds, alternating
//! cargo run --release --example pick_cost -- 9       # more rounds
//! ```
//!
//! Single-threaded; each figure is the median of its rounds, in ns per operation.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rankgate::config::Config;
use rankgate::policy::{Avoid, Selector};
use rankgate::table::{Load, RankTelemetry, RankView, Snapshot, Table};
use rankgate::worker::Fleet;

const RANKS: u32 = 64;

fn table() -> Arc<Table> {
    let text = (0..RANKS / 8)
        .map(|e| {
            format!(
                "[[engines]]\nurl = \"http://10.0.0.{e}:8000\"\nflavor = \"vllm\"\ndp_size = 8\nstart_rank = {}\n",
                e * 8
            )
        })
        .collect::<String>();
    let cfg = Config::from_str(&text).expect("config");
    let table = Table::new(Fleet::expand(cfg.engines), Duration::from_secs(3600));
    let now = tokio::time::Instant::now();
    let snap = table.snapshot.load();
    // KV spread over [0.20, 0.36]: a dozen ranks within affinity's default margin of the best.
    let ranks = (0..RANKS)
        .map(|r| RankView {
            telemetry: RankTelemetry::Available(Load {
                kv_usage: 0.2 + f64::from(r % 17) * 0.01,
                running: Some(4),
                waiting: Some(0),
                used_tokens: None,
                capacity_tokens: Some(262_144),
                aggregate: false,
                upstream: None,
                sampled_at: now,
            }),
            reachable: true,
            weight_at_poll: 0,
            kv_per_request: 0.02,
            source: "bench",
        })
        .collect();
    table.snapshot.store(Arc::new(Snapshot {
        fleet: snap.fleet.clone(),
        ranks,
        catalog: snap.catalog.clone(),
    }));
    table
}

fn selector(affinity: bool) -> Selector {
    let text = format!(
        "[routing]\nprefix_affinity = {affinity}\n[[engines]]\nurl = \"http://h:1\"\nflavor = \"vllm\"\n"
    );
    Selector::new(&Config::from_str(&text).expect("config").routing)
}

/// A chat body: a system prompt of `system` bytes and a few turns.
fn chat(system: usize) -> Vec<u8> {
    let messages = serde_json::json!([
        {"role": "system", "content": "You are a careful assistant. ".repeat(system / 29)},
        {"role": "user", "content": "What is prefill?"},
        {"role": "assistant", "content": "Reading the prompt into the KV cache."},
        {"role": "user", "content": "And decode?"},
    ]);
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages, "stream": true}))
        .expect("json")
}

/// ns per call of `f` over `n` calls.
fn time(n: u32, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    for _ in 0..n {
        f();
    }
    start.elapsed().as_nanos() as f64 / f64::from(n)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(5, |a| a.parse().expect("rounds: a number"));
    let table = table();
    let (plain, affine) = (selector(false), selector(true));
    let none = Avoid::default();
    let bodies = [("8 KiB", chat(8 << 10)), ("64 KiB", chat(64 << 10))];
    let prompts: Vec<Vec<u64>> = bodies
        .iter()
        .map(|(_, b)| rankgate::prefix::prompt_chunks(b))
        .collect();
    // Warm every rank's index: each holds some conversation's prefix, a few hold this one's.
    for (w, seat) in table.snapshot.load().fleet.workers.iter().enumerate() {
        let other: Vec<u64> = (0..32).map(|i| (w as u64) << 32 | i).collect();
        seat.prefixes.record(&other, 4096);
        if w % 16 == 0 {
            seat.prefixes
                .record(&prompts[0][..prompts[0].len() / 2], 4096);
        }
    }

    let n = 20_000;
    let mut rows: Vec<(&str, Vec<f64>)> = vec![
        ("pick, 64 ranks, least_kv", vec![]),
        ("pick, 64 ranks, least_kv + affinity, 8 KiB prompt", vec![]),
        ("pick, 64 ranks, least_kv + affinity, 64 KiB prompt", vec![]),
        ("scan `model` (what select does), 8 KiB body", vec![]),
        ("prompt chunk names, 8 KiB body", vec![]),
        ("scan `model`, 64 KiB body", vec![]),
        ("prompt chunk names, 64 KiB body", vec![]),
    ];
    for _ in 0..rounds {
        // Picks are dropped at once: no credit builds up between them.
        rows[0].1.push(time(n, || {
            black_box(plain.pick(&table, None, &none).ok());
        }));
        for (i, p) in prompts.iter().enumerate() {
            rows[1 + i].1.push(time(n, || {
                black_box(affine.pick_explained(&table, None, &none, p, None).ok());
            }));
        }
        for (i, (_, body)) in bodies.iter().enumerate() {
            rows[3 + 2 * i].1.push(time(n, || {
                black_box(rankgate::proxy::json_member(black_box(body), "model").ok());
            }));
            rows[4 + 2 * i].1.push(time(n, || {
                black_box(rankgate::prefix::prompt_chunks(black_box(body)));
            }));
        }
    }
    let base = median(rows[0].1.clone());
    println!("| operation | ns (median of {rounds} rounds) | vs the pick without affinity |");
    println!("|---|---|---|");
    for (name, v) in rows {
        let m = median(v);
        println!("| {name} | {m:.0} | {:.2}x |", m / base);
    }
}
