//! Telemetry's own costs: parsing the real 70 KB `/metrics` capture of a vLLM 0.32 engine with
//! two DP ranks, and one snapshot publish for 256 engines x 8 ranks.
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
