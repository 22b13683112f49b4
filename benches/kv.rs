//! Exact prefix routing's own costs, beside tokenization (benches/tokenize.rs):
//! - `lookup/{1k,8k,32k}`: a prompt's token ids named in blocks of 128 (`kv::block_hashes`)
//!   and looked up in a rank index holding all of them (the worst case: every block matches);
//! - `ingest`: rank 0's messages of the real DP=2 capture decoded and applied to a fresh
//!   index, per event (each stores or removes a block of 128 tokens);
//! - and, printed once, the index's memory per 100,000 cached blocks.
//!
//!   cargo bench --bench kv

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rankgate::kv::event::{Batch, Event, Message};
use rankgate::kv::{block_hashes, decode, RankIndex, Writer};

const CAPTURE: &str = include_str!("../tests/fixtures/vllm-0.32-kv-events/events-dp2.jsonl");

/// An index holding `tokens` as one stored sequence of 128-token blocks.
fn index_holding(tokens: &[u32]) -> (Arc<RankIndex>, Writer) {
    let index = Arc::new(RankIndex::default());
    let mut w = Writer::new(index.clone());
    let blocks = tokens.len() / 128;
    let stored = Event::Stored {
        hashes: (1..=blocks as u64).collect(),
        parent: None,
        tokens: tokens[..blocks * 128].to_vec(),
        block_size: 128,
        special: false,
    };
    let batch = Batch {
        ts: 0.0,
        events: vec![stored],
        dp_rank: Some(0),
    };
    w.apply(&Message {
        topic: b"kv".to_vec(),
        seq: 0,
        batch,
    });
    (index, w)
}

fn bench(c: &mut Criterion) {
    // Memory per 100k blocks, printed for docs/benchmarks.md.
    let tokens: Vec<u32> = (0..100_000u32 * 128).map(|i| i % 50_000).collect();
    let (index, _w) = index_holding(&tokens);
    eprintln!(
        "index of {} blocks: {} bytes, {:.1} bytes per block",
        index.blocks(),
        index.memory_bytes(),
        index.memory_bytes() as f64 / index.blocks() as f64
    );
    drop(index);

    let mut g = c.benchmark_group("lookup");
    for n in [1024usize, 8192, 32768] {
        let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % 50_000).collect();
        let (index, _w) = index_holding(&tokens);
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| {
                let names = block_hashes(black_box(&tokens), 128);
                black_box(index.matched_blocks(&names))
            })
        });
    }
    g.finish();

    // Rank 0's messages: one unbroken sequence (3..44), as one rank's feed reads them.
    let msgs: Vec<Vec<Vec<u8>>> = (rankgate::kv::capture::read(CAPTURE).unwrap().into_iter())
        .filter(|r| r.rank == 0)
        .map(|r| r.frames)
        .collect();
    let events: usize = msgs
        .iter()
        .map(|m| decode(m).unwrap().batch.events.len())
        .sum();
    let mut g = c.benchmark_group("ingest");
    g.throughput(Throughput::Elements(events as u64));
    g.bench_function("capture", |b| {
        b.iter(|| {
            let mut w = Writer::new(Arc::new(RankIndex::default()));
            for m in &msgs {
                w.apply(&decode(black_box(m)).unwrap());
            }
            black_box(w.index().blocks())
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
