//! OTLP export (feature `otlp`), end to end: the real `rankgate serve` binary with
//! `[tracing] otlp_endpoint` pointing at a collector of this test (OTLP/HTTP protobuf on
//! 127.0.0.1:0), a simulated engine, one traced request, then SIGTERM: the spans must reach the
//! collector by the time rankgate exits, continue the client's trace, carry the pick, nest the
//! upstream attempt under the request, and name that attempt as the engine's parent.
#![cfg(all(feature = "otlp", feature = "sim"))]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::binary::Rankgate;
use common::*;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use prost::Message;
use rankgate_sim::sim::SimConfig;

// The OTLP messages this test reads (opentelemetry/proto/collector/trace/v1 and trace/v1):
// only the fields it looks at; prost skips the rest.
#[derive(Clone, PartialEq, Message)]
struct ExportTraceServiceRequest {
    #[prost(message, repeated, tag = "1")]
    resource_spans: Vec<ResourceSpans>,
}
#[derive(Clone, PartialEq, Message)]
struct ResourceSpans {
    #[prost(message, optional, tag = "1")]
    resource: Option<Resource>,
    #[prost(message, repeated, tag = "2")]
    scope_spans: Vec<ScopeSpans>,
}
#[derive(Clone, PartialEq, Message)]
struct Resource {
    #[prost(message, repeated, tag = "1")]
    attributes: Vec<KeyValue>,
}
#[derive(Clone, PartialEq, Message)]
struct ScopeSpans {
    #[prost(message, repeated, tag = "2")]
    spans: Vec<Span>,
}
#[derive(Clone, PartialEq, Message)]
struct Span {
    #[prost(bytes = "vec", tag = "1")]
    trace_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    span_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "4")]
    parent_span_id: Vec<u8>,
    #[prost(string, tag = "5")]
    name: String,
    #[prost(int32, tag = "6")]
    kind: i32,
    #[prost(message, repeated, tag = "9")]
    attributes: Vec<KeyValue>,
}
#[derive(Clone, PartialEq, Message)]
struct KeyValue {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(message, optional, tag = "2")]
    value: Option<AnyValue>,
}
#[derive(Clone, PartialEq, Message)]
struct AnyValue {
    #[prost(string, optional, tag = "1")]
    string_value: Option<String>,
    #[prost(bool, optional, tag = "2")]
    bool_value: Option<bool>,
    #[prost(int64, optional, tag = "3")]
    int_value: Option<i64>,
}

const SERVER: i32 = 2;
const CLIENT: i32 = 3;

fn attr(attrs: &[KeyValue], key: &str) -> Option<String> {
    let v = attrs.iter().find(|kv| kv.key == key)?.value.as_ref()?;
    v.string_value
        .clone()
        .or(v.int_value.map(|i| i.to_string()))
        .or(v.bool_value.map(|b| b.to_string()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// An OTLP/HTTP collector on 127.0.0.1:0 keeping every export request it is sent, and
/// answering `answer` (when 200: 400 to anything that is not an OTLP protobuf export).
async fn collector(
    answer: StatusCode,
) -> (
    std::net::SocketAddr,
    Arc<Mutex<Vec<ExportTraceServiceRequest>>>,
) {
    let listener = tokio::net::TcpListener::bind(loopback()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let got: Arc<Mutex<Vec<ExportTraceServiceRequest>>> = Arc::default();
    let kept = got.clone();
    tokio::spawn(async move {
        loop {
            let Ok((conn, _)) = listener.accept().await else {
                return;
            };
            let kept = kept.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let kept = kept.clone();
                    async move {
                        let ok = req.uri().path() == "/v1/traces"
                            && req.headers()["content-type"] == "application/x-protobuf";
                        let body = req.into_body().collect().await?.to_bytes();
                        let status = match ExportTraceServiceRequest::decode(body) {
                            Ok(export) if ok => {
                                kept.lock().unwrap().push(export);
                                answer
                            }
                            _ => StatusCode::BAD_REQUEST,
                        };
                        let mut resp = Response::new(Full::new(Bytes::new()));
                        *resp.status_mut() = status;
                        resp.headers_mut()
                            .insert("content-type", "application/x-protobuf".parse().unwrap());
                        Ok::<_, hyper::Error>(resp)
                    }
                });
                let io = hyper_util::rt::TokioIo::new(conn);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(io, svc)
                    .await;
            });
        }
    });
    (addr, got)
}

/// `rankgate serve` with these `[tracing]` keys in front of `engines`, once every rank reports.
async fn serve(name: &str, tracing: &str, engines: &str) -> Rankgate {
    let config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\nshutdown_delay = \"0s\"\n\
         {FAST}[tracing]\n{tracing}{engines}"
    );
    let rg = Rankgate::start(name, &config, None).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let available = |v: serde_json::Value| {
        v.as_array()
            .is_some_and(|rows| rows.iter().all(|w| w["telemetry"] == "available"))
    };
    // Each check is a real request to the admin listener, bounded in time.
    while !available(get(rg.admin_addr, "/workers").await.json()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "ranks never available"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    rg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_the_collector_continuing_the_clients_trace() {
    let (collector_addr, exports) = collector(StatusCode::OK).await;
    let e = engine(SimConfig {
        kv_usage: vec![0.6, 0.2],
        ..sim(rankgate_sim::sim::SimFlavor::Vllm, 2, 0)
    })
    .await;
    let tracing =
        format!("otlp_endpoint = \"http://{collector_addr}\"\nservice_name = \"rankgate-test\"\n");
    let mut rg = serve("otlp", &tracing, &engine_toml(&e.url(), "vllm", 2, 0)).await;

    let (client_trace, client_span) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    let reply = send(
        post(rg.addr, "/v1/chat/completions")
            .header("traceparent", format!("00-{client_trace}-{client_span}-01"))
            .body(Full::new(Bytes::from(chat_body(4, false))))
            .unwrap(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let worker = reply.worker();
    assert!(worker.ends_with("@1"), "the idler rank: {worker}");

    // SIGTERM: the last batch is sent before the process exits.
    rg.signal(libc::SIGTERM);
    let status = rg
        .wait_exit(Duration::from_secs(30))
        .await
        .expect("rankgate exits");
    assert!(status.success(), "{status:?}\n{}", rg.log().join("\n"));

    let exports = exports.lock().unwrap().clone();
    assert!(!exports.is_empty(), "no export reached the collector");
    let resource = &exports[0].resource_spans[0]
        .resource
        .as_ref()
        .unwrap()
        .attributes;
    assert_eq!(
        attr(resource, "service.name").as_deref(),
        Some("rankgate-test")
    );
    let spans: Vec<Span> = (exports.iter())
        .flat_map(|x| &x.resource_spans)
        .flat_map(|r| &r.scope_spans)
        .flat_map(|s| s.spans.clone())
        .collect();
    let request = (spans.iter())
        .find(|s| s.kind == SERVER)
        .unwrap_or_else(|| panic!("no request span in {spans:?}"));
    assert_eq!(request.name, "POST /v1/chat/completions");
    assert_eq!(
        hex(&request.trace_id),
        client_trace,
        "the client's trace continues"
    );
    assert_eq!(
        hex(&request.parent_span_id),
        client_span,
        "under the client's span"
    );
    let a = &request.attributes;
    assert_eq!(attr(a, "worker").as_deref(), Some(worker.as_str()));
    assert_eq!(attr(a, "http.response.status_code").as_deref(), Some("200"));
    assert_eq!(attr(a, "pick.policy").as_deref(), Some("least_kv"));
    let candidates = attr(a, "pick.candidates").unwrap();
    assert!(
        candidates.starts_with(&format!("{worker}=")),
        "{candidates}"
    );
    assert!(
        candidates.contains(&format!("{}@0=", e.url())),
        "{candidates}"
    );

    let upstream = (spans.iter())
        .find(|s| s.kind == CLIENT)
        .unwrap_or_else(|| panic!("no upstream span in {spans:?}"));
    assert_eq!(upstream.name, "upstream");
    assert_eq!(upstream.trace_id, request.trace_id);
    assert_eq!(
        upstream.parent_span_id, request.span_id,
        "a child of the request"
    );
    assert_eq!(
        attr(&upstream.attributes, "worker").as_deref(),
        Some(worker.as_str())
    );

    // The engine's parent is the attempt's span: its own spans nest under it.
    let seen = e.seen();
    let tp = seen.last().and_then(|s| s.traceparent.clone()).unwrap();
    assert_eq!(
        tp,
        format!("00-{client_trace}-{}-01", hex(&upstream.span_id))
    );
}

/// A collector that refuses every export: requests are served as ever, and the lost spans are
/// logged (once per 30 s), not silently dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_collector_is_logged_and_costs_no_request() {
    let (collector_addr, exports) = collector(StatusCode::INTERNAL_SERVER_ERROR).await;
    let e = engine(sim(rankgate_sim::sim::SimFlavor::Vllm, 1, 0)).await;
    let tracing = format!("otlp_endpoint = \"http://{collector_addr}\"\n");
    let mut rg = serve("otlp-500", &tracing, &engine_toml(&e.url(), "vllm", 1, 0)).await;
    let reply = send(
        post(rg.addr, "/v1/chat/completions")
            .body(Full::new(Bytes::from(chat_body(2, false))))
            .unwrap(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    rg.signal(libc::SIGTERM);
    let status = rg
        .wait_exit(Duration::from_secs(30))
        .await
        .expect("rankgate exits");
    assert!(status.success(), "{status:?}");
    assert!(
        !exports.lock().unwrap().is_empty(),
        "the export was attempted"
    );
    let line = rg
        .wait_log("OTLP export failed", Duration::from_secs(5))
        .await;
    assert!(line.contains("500"), "{line}");
}
