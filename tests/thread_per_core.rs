//! `server.thread_per_core` (the default: one runtime per core) and its alternative, one shared
//! runtime, over real sockets. Every connection (each of `send`'s requests opens its own) is
//! served whichever core's listener the kernel hands it to, requests still go to the least
//! loaded rank, streams pass through, and the shutdown drains every core's streams before it
//! returns. (The connection cap across cores: tests/faults/clients/fd_limit.rs, in the default mode.)

mod common;

use std::time::Duration;

use common::*;
use http_body_util::BodyExt;
use rankgate_sim::sim::{SimConfig, SimFlavor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PER_CORE: &str = "thread_per_core = true";
const SHARED: &str = "thread_per_core = false";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_is_served_and_routed_by_load_per_core() {
    served_and_routed(PER_CORE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_is_served_and_routed_by_load_on_one_runtime() {
    served_and_routed(SHARED).await;
}

async fn served_and_routed(mode: &str) {
    let e = engine(SimConfig {
        kv_usage: vec![0.9, 0.1],
        ..sim(SimFlavor::Vllm, 2, 0)
    })
    .await;
    let r = router_with(mode, FAST, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    wait_state(&r, &[0, 1], "available").await;
    for _ in 0..40 {
        let reply = chat(r.addr, 2).await;
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        // Rank 0 is full and the requests are short: least KV is rank 1 every time.
        assert!(reply.worker().ends_with("@1"), "{}", reply.worker());
    }
    let metrics = get(r.admin_addr, "/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body);
    let served: f64 = text
        .lines()
        .filter(|l| l.starts_with("rankgate_requests_total{") && l.contains("status=\"200\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(served, 40.0, "every core counts into the same metrics");
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_on_every_core_finish_before_shutdown_returns() {
    let e = engine(SimConfig {
        decode_tokens_per_sec: 100.0,
        ..sim(SimFlavor::Vllm, 2, 0)
    })
    .await;
    let r = router_with(PER_CORE, FAST, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    wait_state(&r, &[0, 1], "available").await;
    let addr = r.addr;
    // Several connections, so that with more than one core some land on each.
    let mut streams = Vec::new();
    for _ in 0..6 {
        let resp = stream_chat(addr, 30).await;
        assert_eq!(resp.status(), 200);
        streams.push(tokio::spawn(async move {
            let body = resp.into_body().collect().await.expect("whole stream");
            String::from_utf8_lossy(&body.to_bytes()).into_owned()
        }));
    }
    let stopped = tokio::spawn(r.shutdown());
    for s in streams {
        let text = tokio::time::timeout(Duration::from_secs(20), s)
            .await
            .expect("stream ends")
            .unwrap();
        assert!(text.trim_end().ends_with("data: [DONE]"), "cut: {text}");
    }
    tokio::time::timeout(Duration::from_secs(20), stopped)
        .await
        .expect("shutdown returns once drained")
        .unwrap();
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "no core accepts after the shutdown"
    );
}

/// The connection cap counts clients, not listeners: with a cap below the number of cores,
/// every new connection is still served whichever core's listener gets it (a slot held by an
/// idle core's listener once left clients of the other core waiting forever), and as many
/// clients as the cap allows are served at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_cap_counts_clients_whichever_core_accepts_them() {
    let e = engine(sim(SimFlavor::Vllm, 2, 0)).await;
    for cap in [1, 4] {
        let server = format!("{PER_CORE}\nmax_connections = {cap}");
        let r = router_with(&server, FAST, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
        for round in 0..10 {
            // `cap` clients at once, each on its own connection, all held open until all
            // are answered.
            let mut held = Vec::new();
            for _ in 0..cap {
                let mut s = tokio::net::TcpStream::connect(r.addr).await.unwrap();
                s.write_all(b"GET /nope HTTP/1.1\r\nhost: x\r\n\r\n")
                    .await
                    .unwrap();
                held.push(s);
            }
            for s in &mut held {
                let mut buf = [0u8; 12];
                tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut buf))
                    .await
                    .unwrap_or_else(|_| {
                        panic!("cap {cap}, round {round}: a client under the cap got no answer")
                    })
                    .unwrap();
                assert_eq!(&buf, b"HTTP/1.1 404");
            }
        }
        r.shutdown().await;
    }
}

/// A port another rankgate holds is an error, as without thread-per-core: SO_REUSEPORT would
/// otherwise let the second one start and take part of the first one's clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_another_rankgate_holds_is_an_error() {
    let e = engine(sim(SimFlavor::Vllm, 2, 0)).await;
    let first = router_with(PER_CORE, FAST, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    let text = format!(
        "[server]\nlisten = \"{}\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n{PER_CORE}\n{FAST}{}",
        first.addr,
        engine_toml(&e.url(), "vllm", 2, 0)
    );
    let second =
        rankgate::app::Router::start(rankgate::config::Config::from_str(&text).unwrap()).await;
    let err = second
        .err()
        .expect("the second rankgate must not start")
        .to_string();
    assert!(
        err.contains("server.listen") && err.contains(&first.addr.to_string()),
        "{err}"
    );
    first.shutdown().await;
}
