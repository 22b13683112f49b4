//! Telemetry's own costs: parsing the real 70 KB `/metrics` capture of a vLLM 0.32 engine with
//! two DP ranks and a 64-rank scrape of only the series rankgate reads, and one snapshot publish for 256 engines x 8 ranks.
//!
//!   cargo bench --bench telemetry

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};

mod common;

fn telemetry(c: &mut Criterion) {
    let capture = include_str!("../tests/fixtures/vllm-0.32-dp2-metrics-under-load.txt");
    c.bench_function("prometheus_parse/vllm-0.32-dp2 (68 KB)", |b| {
        b.iter(|| black_box(rankgate::telemetry::prom::parse(black_box(capture))))
    });

    // What the simulated engine of the fleet-scale check serves: 64 ranks, every line one
    // rankgate reads (a real engine's scrape is mostly other series, skipped on their name).
    let mut sim64 = String::new();
    for (name, v) in [
        ("vllm:kv_cache_usage_perc", "0.25"),
        ("vllm:num_requests_running", "3"),
        ("vllm:num_requests_waiting", "0"),
    ] {
        sim64 += &format!("# HELP {name} simulated\n# TYPE {name} gauge\n");
        for r in 0..64 {
            sim64 += &format!("{name}{{engine=\"{r}\",model_name=\"tiny-llama\"}} {v}\n");
        }
    }
    for r in 0..64 {
        sim64 += &format!("vllm:cache_config_info{{block_size=\"16\",engine=\"{r}\",kv_cache_size_tokens=\"65536\",num_gpu_blocks=\"4096\"}} 1.0\n");
    }
    c.bench_function("prometheus_parse/64 ranks, 256 samples", |b| {
        b.iter(|| black_box(rankgate::telemetry::prom::parse(black_box(&sim64))))
    });

    let table = common::table(256 * 8);
    let snap = table.snapshot.load_full();
    let mut views = snap.ranks.clone();
    c.bench_function("publish/256 engines x 8 ranks", |b| {
        b.iter(|| {
            let next =
                rankgate::telemetry::next_snapshot(&snap.fleet, &mut views, &snap.catalog, 0.02);
            table.snapshot.store(std::sync::Arc::new(black_box(next)));
        })
    });
}

criterion_group!(benches, telemetry);
criterion_main!(benches);
