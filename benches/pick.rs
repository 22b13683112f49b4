//! The pick: `least_kv` over 8, 64 and 1,024 ranks, with and without prefix affinity (a prompt
//! of 32 chunks, a few ranks holding half of it); and the body reads, on 8 KiB and 64 KiB chat
//! bodies: the prompt's chunk names (what affinity adds) and the `model` scan (what every
//! request to a multi-model fleet already pays).
//!
//!   cargo bench --bench pick

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use rankgate::config::Config;
use rankgate::policy::{Avoid, Selector};

mod common;

fn selector(affinity: bool) -> Selector {
    let text = format!(
        "[routing]\nprefix_affinity = {affinity}\n[[engines]]\nurl = \"http://h:1\"\nflavor = \"vllm\"\n"
    );
    Selector::new(&Config::from_str(&text).expect("config").routing)
}

/// A chat body with a system prompt of about `kib` KiB.
fn chat_body(kib: usize) -> Vec<u8> {
    let messages = serde_json::json!([
        {"role": "system", "content": "You are a careful assistant. ".repeat(kib * 35)},
        {"role": "user", "content": "What is prefill?"},
    ]);
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).expect("json")
}

fn pick(c: &mut Criterion) {
    let body = chat_body(8);
    let prompt = rankgate::prompt::Prompt {
        chunks: rankgate::prefix::prompt_chunks(&body),
        tokens: None,
    };
    let none = Avoid::default();
    let mut g = c.benchmark_group("pick");
    for ranks in [8u32, 64, 1024] {
        let table = common::table(ranks);
        for (w, seat) in table.snapshot.load().fleet.workers.iter().enumerate() {
            let other: Vec<u64> = (0..32).map(|i| (w as u64) << 32 | i).collect();
            seat.prefixes.record(&other, 4096);
            if w % 16 == 0 {
                seat.prefixes
                    .record(&prompt.chunks[..prompt.chunks.len() / 2], 4096);
            }
        }
        let (plain, affine) = (selector(false), selector(true));
        g.bench_with_input(BenchmarkId::new("least_kv", ranks), &ranks, |b, _| {
            // The guard is dropped at once: no credit builds up between picks.
            b.iter(|| black_box(plain.pick(&table, None, &none).ok()))
        });
        g.bench_with_input(
            BenchmarkId::new("least_kv+affinity", ranks),
            &ranks,
            |b, _| {
                b.iter(|| {
                    black_box(
                        affine
                            .pick_explained(&table, None, &none, &prompt, None)
                            .ok(),
                    )
                })
            },
        );
    }
    g.finish();
    for kib in [8, 64] {
        let body = chat_body(kib);
        c.bench_function(&format!("prompt_chunks/{kib}KiB"), |b| {
            b.iter(|| black_box(rankgate::prefix::prompt_chunks(black_box(&body))))
        });
        c.bench_function(&format!("model_scan/{kib}KiB"), |b| {
            b.iter(|| black_box(rankgate::proxy::json_member(black_box(&body), "model").ok()))
        });
    }
}

criterion_group!(benches, pick);
criterion_main!(benches);
