//! Heap allocations per proxied request, counted by a global allocator: the request path's
//! allocations are CPU (and allocator lock traffic) on every request, so they are counted here
//! rather than guessed from profiles.
//!
//! The router runs in this process on its own runtime; the fake engines and the load client run
//! on another runtime whose threads are not counted, so the figures are the router's alone
//! (its telemetry polls included, a few per second against thousands of requests).
//!
//!   cargo bench --bench allocs

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use rankgate::app::Router;
use rankgate::config::Config;

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Set on the threads of the load client and the fake engines.
    static NOT_COUNTED: Cell<bool> = const { Cell::new(false) };
}

fn counted() -> bool {
    !NOT_COUNTED.try_with(Cell::get).unwrap_or(true)
}

// SAFETY: every call is passed on to the system allocator unchanged; the counters are atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if counted() {
            ALLOCS.fetch_add(1, Relaxed);
            BYTES.fetch_add(layout.size() as u64, Relaxed);
        }
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if counted() {
            ALLOCS.fetch_add(1, Relaxed);
            BYTES.fetch_add(new_size as u64, Relaxed);
        }
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const METRICS: &str = include_str!("../tests/fixtures/vllm-0.32-dp2-metrics.txt");
const CONNECTIONS: usize = 8;
const REQUESTS: usize = 20_000;

/// A fake engine on 127.0.0.1:0 serving `model`: a fixed chat completion, the real vLLM DP=2
/// `/metrics` capture, `/health` and `/v1/models`.
async fn engine(model: &'static str) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::watch::channel(false);
    std::mem::forget(tx);
    let handler = move |req: Request<hyper::body::Incoming>| async move {
        let body = match req.uri().path() {
            "/metrics" => Bytes::from_static(METRICS.as_bytes()),
            "/v1/models" => Bytes::from(format!(
                r#"{{"object":"list","data":[{{"id":"{model}","object":"model"}}]}}"#
            )),
            _ => Bytes::from_static(
                br#"{"id":"cmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}]}"#,
            ),
        };
        Ok::<_, Infallible>(Response::new(Full::new(body)))
    };
    tokio::spawn(rankgate::http::serve(listener, handler, rx));
    url
}

fn engine_toml(url: &str, flavor: &str, start_rank: u32) -> String {
    format!(
        "[[engines]]\nurl = \"{url}\"\nflavor = \"{flavor}\"\ndp_size = 2\nstart_rank = {start_rank}\ntelemetry = [\"prometheus\"]\n"
    )
}

/// Sends `REQUESTS` chat completions over `CONNECTIONS` keep-alive connections.
async fn load(addr: std::net::SocketAddr) {
    let client = rankgate::http::client::<Full<Bytes>>(Duration::from_secs(2));
    let body = Bytes::from_static(
        br#"{"model":"tiny-llama","messages":[{"role":"user","content":"hello"}],"max_tokens":8}"#,
    );
    let tasks: Vec<_> = (0..CONNECTIONS)
        .map(|_| {
            let (client, body) = (client.clone(), body.clone());
            tokio::spawn(async move {
                for _ in 0..REQUESTS / CONNECTIONS {
                    let req = Request::post(format!("http://{addr}/v1/chat/completions"))
                        .header("content-type", "application/json")
                        .body(Full::new(body.clone()))
                        .unwrap();
                    let resp = client.request(req).await.expect("request");
                    assert!(resp.status().is_success(), "{}", resp.status());
                    resp.into_body().collect().await.expect("body");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

fn main() {
    // `cargo test --benches` runs bench binaries with `--test`: nothing to measure then.
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let outside = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .on_thread_start(|| NOT_COUNTED.set(true))
        .enable_all()
        .build()
        .unwrap();
    NOT_COUNTED.set(true);
    let (a, b) = outside.block_on(async { (engine("tiny-llama").await, engine("other").await) });
    let cases = [
        (
            "vLLM path (rank in a header)",
            "",
            engine_toml(&a, "vllm", 0),
        ),
        (
            "vLLM path, one shared runtime (thread_per_core = false)",
            "thread_per_core = false\n",
            engine_toml(&a, "vllm", 0),
        ),
        (
            "SGLang path (rank written into the body)",
            "",
            engine_toml(&a, "sglang", 0),
        ),
        (
            "two models (body scanned for `model`)",
            "",
            engine_toml(&a, "vllm", 0) + &engine_toml(&b, "vllm", 2),
        ),
    ];
    println!("| path | allocations / request | bytes allocated / request |");
    println!("|---|---|---|");
    for (name, server, engines) in cases {
        let router_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{server}\
             [telemetry]\ninterval = \"1s\"\n{engines}"
        );
        let router = router_rt.block_on(async {
            Router::start(Config::from_str(&text).expect("config"))
                .await
                .expect("router")
        });
        let addr = router.addr;
        // Warm up: telemetry in, models known, pools filled.
        let deadline = Instant::now() + Duration::from_secs(10);
        outside.block_on(async {
            while Instant::now() < deadline {
                let models = rankgate::http::client::<Full<Bytes>>(Duration::from_secs(1))
                    .get(format!("http://{addr}/v1/models").parse().unwrap())
                    .await;
                if let Ok(r) = models {
                    let body = r.into_body().collect().await.unwrap().to_bytes();
                    let want = if engines.matches("[[engines]]").count() == 2 {
                        "other"
                    } else {
                        "tiny-llama"
                    };
                    if body.windows(want.len()).any(|w| w == want.as_bytes()) {
                        break;
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        outside.block_on(load(addr));
        let (a0, b0) = (ALLOCS.load(Relaxed), BYTES.load(Relaxed));
        outside.block_on(load(addr));
        let (a1, b1) = (ALLOCS.load(Relaxed), BYTES.load(Relaxed));
        println!(
            "| {name} | {:.1} | {:.0} |",
            (a1 - a0) as f64 / REQUESTS as f64,
            (b1 - b0) as f64 / REQUESTS as f64
        );
        router_rt.block_on(router.shutdown());
    }
}
