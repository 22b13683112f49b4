//! What a client learns of the fleet with the default settings, over real sockets: nothing. No
//! `x-rankgate-worker` header or gRPC metadata, and no engine address, internal URL or setting
//! name in any answer rankgate makes itself: 200, 404, 408, 413, 429, 502, 503, 504, a stream cut
//! by the idle timeout, and the gRPC statuses of engines that refuse and hang; and none of the
//! engine's own headers that name it (`Server`, `Via`, `Alt-Svc`, `Set-Cookie`, rank headers),
//! nor an engine header larger than rankgate's bound. (The tests that read the worker header ask
//! for it with `expose_worker = "url"`; `name` is proven here too.)
#![cfg(feature = "sim")] // the simulated engine

mod common;

use std::time::Duration;

use common::grpc::{generate_bytes, method_path, raw_call, refusing_port, Eng};
use common::*;
use http::HeaderMap;
use http_body_util::BodyExt;
use rankgate::app::Router;
use rankgate::config::Config;
use rankgate_sim::sim::SimFlavor as Flavor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

/// A router with the default `server.expose_worker`, `server` more `[server]` keys.
async fn start(server: &str, extra: &str, engines: &[String]) -> Router {
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{server}\n{extra}\n{}",
        engines.concat()
    );
    let cfg = Config::from_str(&text).unwrap_or_else(|e| panic!("config: {e}\n{text}"));
    Router::start(cfg).await.expect("start router")
}

/// Asserts the answer names no engine (`addrs`: their `host:port`) and no setting.
fn assert_discreet(what: &str, headers: &HeaderMap, body: &[u8], addrs: &[String]) {
    assert!(
        !headers.contains_key("x-rankgate-worker"),
        "{what}: {headers:?}"
    );
    let mut texts: Vec<String> = (headers.values())
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .collect();
    texts.push(String::from_utf8_lossy(body).into_owned());
    for t in &texts {
        for a in addrs {
            assert!(!t.contains(a.as_str()), "{what} names an engine: {t}");
        }
        for inside in ["://", "server.", "routing.", "telemetry.", "engines["] {
            assert!(!t.contains(inside), "{what} says {inside:?}: {t}");
        }
    }
}

fn authority(url: &str) -> String {
    url.trim_start_matches("http://").to_string()
}

/// Sends a request head announcing `length` bytes of body, then only part of it, and reads the
/// answer (bounded).
async fn stalled_body(addr: std::net::SocketAddr) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\nconnection: close\r\n\r\n{\"model\":";
    s.write_all(head.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("answered within 10 s")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn http_answers_name_no_engine_and_no_setting_by_default() {
    let e = engine(sim(Flavor::Vllm, 2, 0)).await;
    let addrs = [authority(&e.url())];
    let r = start(
        "max_body_bytes = 1024\nbody_read_timeout = \"300ms\"\nstream_idle_timeout = \"300ms\"",
        FAST,
        &[engine_toml(&e.url(), "vllm", 2, 0)],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;

    let ok = chat(r.addr, 4).await;
    assert_eq!(ok.status, 200);
    assert_discreet("200", &ok.headers, b"", &addrs);
    let missing = get(r.addr, "/v2/nothing").await;
    missing.assert_openai_error(404, None);
    assert_discreet("404", &missing.headers, &missing.body, &addrs);
    let big = serde_json::json!({"model": "tiny-llama", "prompt": "x".repeat(2000)});
    let big = post_json(r.addr, "/v1/completions", big).await;
    big.assert_openai_error(413, None);
    assert_discreet("413", &big.headers, &big.body, &addrs);
    let stalled = stalled_body(r.addr).await;
    assert!(stalled.starts_with("HTTP/1.1 408"), "{stalled}");
    assert_discreet("408", &HeaderMap::new(), stalled.as_bytes(), &addrs);

    // A stream the engine stops feeding ends with an error event that names nothing either.
    e.set_stall_after_tokens(Some(2));
    let resp = stream_chat(r.addr, 50).await;
    let (parts, body) = resp.into_parts();
    assert_eq!(parts.status, 200);
    let text = tokio::time::timeout(Duration::from_secs(10), body.collect())
        .await
        .expect("the cut stream ends within 10 s")
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    assert!(text.contains("\"error\""), "{text}");
    assert_discreet("stream cut", &parts.headers, text.as_bytes(), &addrs);
    e.set_stall_after_tokens(None);
    r.shutdown().await;
}

#[tokio::test]
async fn engines_that_hang_die_or_refuse_are_not_named_by_default() {
    // Hanging: 504 after the response timeout; meanwhile a second request is over
    // max_in_flight: 429.
    let hung = engine(sim(Flavor::Vllm, 1, 0)).await;
    let r = start(
        "response_timeout = \"500ms\"\nmax_in_flight = 1",
        FAST,
        &[engine_toml(&hung.url(), "vllm", 1, 0)],
    )
    .await;
    wait_state(&r, &[0], "available").await;
    hung.set_hang_requests(true);
    let first = tokio::spawn(chat(r.addr, 4));
    until(
        "the engine holds the request",
        Duration::from_secs(5),
        || hung.requests_received() == 1,
    )
    .await;
    let addrs = [authority(&hung.url())];
    let over = chat(r.addr, 4).await;
    over.assert_openai_error(429, None);
    assert_discreet("429", &over.headers, &over.body, &addrs);
    let late = first.await.unwrap();
    late.assert_openai_error(504, None);
    assert_discreet("504", &late.headers, &late.body, &addrs);
    r.shutdown().await;

    // Dead after its last poll (slow polls leave it looking fine): 502.
    let doomed = engine(sim(Flavor::Vllm, 1, 0)).await;
    let slow = "[telemetry]\ninterval = \"10s\"\nstale_after = \"60s\"\n";
    let r = start("", slow, &[engine_toml(&doomed.url(), "vllm", 1, 0)]).await;
    wait_state(&r, &[0], "available").await;
    let addrs = [authority(&doomed.url())];
    doomed.kill().await;
    let failed = chat(r.addr, 4).await;
    failed.assert_openai_error(502, None);
    assert_discreet("502", &failed.headers, &failed.body, &addrs);
    r.shutdown().await;

    // Refusing every poll: no routable rank, 503.
    let port = refusing_port().await;
    let url = format!("http://{port}");
    let r = start("", FAST, &[engine_toml(&url, "vllm", 1, 0)]).await;
    let none = chat(r.addr, 4).await;
    none.assert_openai_error(503, None);
    assert_discreet("503", &none.headers, &none.body, &[port.to_string()]);
    r.shutdown().await;
}

#[tokio::test]
async fn grpc_statuses_name_no_engine_by_default() {
    let flavor = Flavor::Vllm;
    let path = method_path(flavor, "Generate");
    let generate = generate_bytes(flavor, "leak-1", None, 3);
    let grpc = "grpc_listen = \"127.0.0.1:0\"\nresponse_timeout = \"500ms\"\nmax_in_flight = 1";

    let good = Eng::start(flavor, 1, 0).await;
    let r = start(grpc, FAST, &[good.toml()]).await;
    wait_state(&r, &[0], "available").await;
    let front = r.grpc_addr.expect("grpc_listen is set");
    let addrs = [good.grpc.to_string()];
    let ok = raw_call(front, &path, &generate).await;
    assert_eq!(ok.code, Code::Ok, "{ok:?}");
    assert_discreet("gRPC OK", &ok.headers, ok.message.as_bytes(), &addrs);

    // Hanging: DEADLINE_EXCEEDED; a second call meanwhile RESOURCE_EXHAUSTED.
    good.sim.set_hang_requests(true);
    let before = good.sim.requests_received();
    let first = tokio::spawn(async move { raw_call(front, &path, &generate).await });
    until("the engine holds the call", Duration::from_secs(5), || {
        good.sim.requests_received() > before
    })
    .await;
    let path = method_path(flavor, "Generate");
    let generate = generate_bytes(flavor, "leak-2", None, 3);
    let over = raw_call(front, &path, &generate).await;
    assert_eq!(over.code, Code::ResourceExhausted, "{over:?}");
    assert_discreet("gRPC over", &over.headers, over.message.as_bytes(), &addrs);
    let late = first.await.unwrap();
    assert_eq!(late.code, Code::DeadlineExceeded, "{late:?}");
    assert_discreet("gRPC late", &late.headers, late.message.as_bytes(), &addrs);
    r.shutdown().await;

    // Calls to a port that refuses them (telemetry from a good engine): UNAVAILABLE.
    let tele = Eng::start(flavor, 1, 0).await;
    let port = refusing_port().await;
    let refusing = format!(
        "[[engines]]\ngrpc_url = \"http://{port}\"\nflavor = \"vllm\"\ndp_size = 1\nstart_rank = 0\ntelemetry = [\"grpc://{}\"]\n",
        tele.grpc
    );
    let r = start(grpc, FAST, &[refusing]).await;
    wait_state(&r, &[0], "available").await;
    let front = r.grpc_addr.expect("grpc_listen is set");
    let refused = raw_call(front, &path, &generate).await;
    assert_eq!(refused.code, Code::Unavailable, "{refused:?}");
    let addrs = [port.to_string(), tele.grpc.to_string()];
    let what = "gRPC refused";
    assert_discreet(what, &refused.headers, refused.message.as_bytes(), &addrs);
    r.shutdown().await;
}

#[tokio::test]
async fn expose_worker_name_tells_the_configured_name_only() {
    let e = engine(sim(Flavor::Vllm, 2, 0)).await;
    let named = format!(
        "{}name = \"decode-a\"\n",
        engine_toml(&e.url(), "vllm", 2, 0)
    );
    let r = start(
        "expose_worker = \"name\"\nresponse_timeout = \"300ms\"",
        FAST,
        &[named],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    let ok = chat(r.addr, 4).await;
    assert_eq!(ok.status, 200);
    let worker = ok.worker();
    assert!(worker == "decode-a@0" || worker == "decode-a@1", "{worker}");
    e.set_hang_requests(true);
    let late = chat(r.addr, 4).await;
    let body = late.assert_openai_error(504, None);
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.starts_with("decode-a@"), "{message}");
    assert!(late.worker().starts_with("decode-a@"));
    let addrs = [authority(&e.url())];
    let mut headers = late.headers.clone();
    headers.remove("x-rankgate-worker");
    assert_discreet("named 504", &headers, &late.body, &addrs);
    // The operator's side shows both: the name and the address it stands for.
    let rows = workers(&r).await;
    assert_eq!(rows[0]["name"], "decode-a@0", "{rows:?}");
    assert_eq!(rows[0]["engine"], e.url(), "{rows:?}");
    r.shutdown().await;
}

#[tokio::test]
async fn engine_headers_that_name_it_never_reach_a_client_unless_url() {
    use common::headers::{HeaderEngine, HUGE_HEADER, NAME_YOURSELF, NAMING};
    let e = HeaderEngine::start().await;
    let table = format!(
        "[[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\ndp_size = 2\ntelemetry = [\"prometheus\"]\nname = \"p1\"\n",
        e.url
    );
    let ask = |addr, header: &str, value: &str| {
        let req = post(addr, "/v1/chat/completions")
            .header(header, value)
            .body(http_body_util::Full::new(bytes::Bytes::from(chat_body(
                4, false,
            ))))
            .unwrap();
        send(req)
    };
    for (mode, shown) in [("none", false), ("name", false), ("url", true)] {
        let r = start(
            &format!("expose_worker = \"{mode}\""),
            FAST,
            std::slice::from_ref(&table),
        )
        .await;
        wait_state(&r, &[0, 1], "available").await;
        let reply = ask(r.addr, NAME_YOURSELF, "1").await;
        assert_eq!(reply.status, 200, "{mode}");
        for (name, value) in NAMING {
            let got = reply.headers.get(name).map(|v| v.as_bytes());
            match shown {
                false => assert_eq!(got, None, "{mode}: {name} reached the client"),
                true => assert_eq!(got, Some(value.as_bytes()), "{mode}: {name}"),
            }
        }
        assert_eq!(reply.headers["content-type"], "application/json");
        if mode == "none" {
            assert_discreet(
                "named by itself",
                &reply.headers,
                &reply.body,
                &[authority(&e.url)],
            );
            for v in reply.headers.values() {
                let v = String::from_utf8_lossy(v.as_bytes());
                assert!(!v.contains("gpu-node-7") && !v.contains("10.77.0.9"), "{v}");
            }
            // A header within the bound passes; one of 200 KB is no answer: 502, never passed.
            let fits = ask(r.addr, HUGE_HEADER, "32768").await;
            assert_eq!(fits.status, 200);
            assert_eq!(fits.headers["x-huge"].len(), 32768);
            let huge = ask(r.addr, HUGE_HEADER, "204800").await;
            huge.assert_openai_error(502, None);
            assert!(!huge.headers.contains_key("x-huge"));
            assert!(huge.body.len() < 1024, "{}", huge.body.len());
        }
        r.shutdown().await;
    }
}
