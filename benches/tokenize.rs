//! The router's own tokenization of a chat request (`rankgate::tokenize`) at about 1k, 8k and
//! 32k prompt tokens, with the fixture model's tokenizer and chat template
//! (tests/fixtures/vllm-0.32-kv-events/): the whole request (`chat`: parse, template, cut,
//! tokenize), the template alone (`render`), the tokenizer alone (`encode`), and the whole
//! request under an 8k-token cap (`chat_capped_8k`), all without the piece cache; and with it,
//! the request that adds a user turn to a conversation whose previous request was tokenized
//! (`chat_next_turn`: the cache holds only that previous request's pieces).
//!
//! Block hashing is not measured here: its function (`kv::hash`) is another module's.
//!
//!   cargo bench --bench tokenize

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use rankgate::tokenize::{ChatTokenizer, Limits};

const WORDS: [&str; 24] = [
    "router",
    "event",
    "engine",
    "hash",
    "token",
    "delta",
    "gamma",
    "prefix",
    "beta",
    "kv",
    "block",
    "alpha",
    "rank",
    "cache",
    "the",
    "of",
    "request",
    "prefill",
    "decode",
    "batch",
    "latency",
    "memory",
    "page",
    "scheduler",
];

fn tokenizer(limits: Limits, cache: usize) -> ChatTokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm-0.32-kv-events");
    ChatTokenizer::from_dir(&dir)
        .expect("fixture tokenizer")
        .with_limits(limits)
        .with_cache(cache)
}

/// A multi-turn chat body of at least `tokens` prompt tokens: a system prompt of 100 words,
/// then user and assistant turns of 80 words of a fixed pseudo-random text, with numbers and
/// punctuation; and the body before its last assistant and user turns (the conversation's
/// previous request).
fn chat_body(tok: &ChatTokenizer, tokens: usize) -> (Vec<u8>, Vec<u8>) {
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) as usize
    };
    let mut turn = |n: usize| -> String {
        let mut text = String::new();
        for i in 0..n {
            let r = next();
            text.push_str(WORDS[r % WORDS.len()]);
            match r % 23 {
                0 => text.push_str(&format!(" {}", r % 10_000)),
                1 => text.push('.'),
                2 => text.push(','),
                _ => {}
            }
            if i + 1 < n {
                text.push(' ');
            }
        }
        text
    };
    let mut messages = vec![serde_json::json!({"role": "system", "content": turn(100)})];
    let mut previous = Vec::new();
    loop {
        let role = if messages.len() % 2 == 1 {
            "user"
        } else {
            "assistant"
        };
        messages.push(serde_json::json!({"role": role, "content": turn(80)}));
        if role == "user" {
            let body = serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages}))
                .expect("json");
            if tok.chat(&body).expect("tokenize").ids.len() >= tokens {
                return (body, previous);
            }
            previous = body;
        }
    }
}

fn tokenize(c: &mut Criterion) {
    let unbounded = Limits {
        max_bytes: usize::MAX,
        max_tokens: usize::MAX,
    };
    let whole = tokenizer(unbounded, 0);
    let cached = tokenizer(unbounded, 64 << 20);
    let capped = tokenizer(
        Limits {
            max_bytes: 8192 * 4,
            max_tokens: 8192,
        },
        0,
    );
    let mut g = c.benchmark_group("tokenize");
    g.sample_size(20).measurement_time(Duration::from_secs(4));
    for tokens in [1024usize, 8192, 32768] {
        let (body, previous) = chat_body(&whole, tokens);
        let (text, _) = whole.render_chat(&body).expect("render");
        let n = whole.chat(&body).expect("tokenize").ids.len();
        eprintln!(
            "{tokens}: {n} tokens, {} bytes of body, {} of text",
            body.len(),
            text.len()
        );
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::new("chat", tokens), &body, |b, body| {
            b.iter(|| whole.chat(black_box(body)).expect("tokenize"))
        });
        g.bench_with_input(BenchmarkId::new("render", tokens), &body, |b, body| {
            b.iter(|| whole.render_chat(black_box(body)).expect("render"))
        });
        g.bench_with_input(BenchmarkId::new("encode", tokens), &text, |b, text| {
            b.iter(|| whole.text(black_box(text), false).expect("encode"))
        });
        g.bench_with_input(
            BenchmarkId::new("chat_capped_8k", tokens),
            &body,
            |b, body| b.iter(|| capped.chat(black_box(body)).expect("tokenize")),
        );
        g.bench_with_input(
            BenchmarkId::new("chat_next_turn", tokens),
            &body,
            |b, body| {
                b.iter_batched(
                    || {
                        cached.clear_cache();
                        cached.chat(&previous).expect("previous turn")
                    },
                    |_| cached.chat(black_box(body)).expect("tokenize"),
                    BatchSize::PerIteration,
                )
            },
        );
    }
    g.finish();
}

criterion_group!(benches, tokenize);
criterion_main!(benches);
