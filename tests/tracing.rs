//! Request tracing over real sockets: the `request` span with the pick as attributes and an
//! `upstream` child per attempt (captured by a subscriber of this test binary), the trace
//! context continued to the engine, and `x-rankgate-debug: 1` with the admin token returning
//! each attempt's pick explanation (refused, with the reason, otherwise).

mod common;

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use common::admin::{token_env, TOKEN};
use common::*;
use http::StatusCode;
use http_body_util::Full;
use rankgate_sim::sim::{SimConfig, SimEngine};
use serde_json::Value;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::Context;
use tracing_subscriber::prelude::*;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// A closed span: its name, fields, and its parent's fields.
#[derive(Debug, Clone, Default)]
struct Closed {
    name: String,
    fields: BTreeMap<String, String>,
    parent: Option<BTreeMap<String, String>>,
}

/// Every `rankgate::trace` span closed in this test binary.
fn closed() -> &'static Mutex<Vec<Closed>> {
    static CLOSED: OnceLock<Mutex<Vec<Closed>>> = OnceLock::new();
    CLOSED.get_or_init(Default::default)
}

#[derive(Default)]
struct Fields(BTreeMap<String, String>);

impl Visit for Fields {
    fn record_debug(&mut self, f: &Field, v: &dyn std::fmt::Debug) {
        self.0.insert(f.name().to_string(), format!("{v:?}"));
    }
    fn record_str(&mut self, f: &Field, v: &str) {
        self.0.insert(f.name().to_string(), v.to_string());
    }
}

/// Keeps each span's fields in its extensions, and the whole span in [`closed`] when it closes.
struct Capture;

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut f = Fields::default();
        attrs.record(&mut f);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(f);
        }
    }
    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(f) = span.extensions_mut().get_mut::<Fields>() {
                values.record(f);
            }
        }
    }
    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let fields = |s: &tracing_subscriber::registry::SpanRef<'_, S>| {
            s.extensions()
                .get::<Fields>()
                .map(|f| f.0.clone())
                .unwrap_or_default()
        };
        let c = Closed {
            name: span.name().to_string(),
            fields: fields(&span),
            parent: span.parent().map(|p| fields(&p)),
        };
        closed().lock().unwrap().push(c);
    }
}

fn capture_spans() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let only = tracing_subscriber::filter::Targets::new()
            .with_target("rankgate::trace", tracing::Level::INFO);
        tracing_subscriber::registry()
            .with(Capture.with_filter(only))
            .init();
    });
}

/// The closed spans named `name` whose field `key` is `value`, waited for (a request's span
/// closes when the server drops its body, just after the client has read it).
async fn spans(name: &str, key: &str, value: &str, want: usize) -> Vec<Closed> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let found: Vec<Closed> = (closed().lock().unwrap().iter())
            .filter(|c| {
                c.name == name
                    && (c.fields.get(key).map(String::as_str) == Some(value)
                        || c.parent
                            .as_ref()
                            .and_then(|p| p.get(key))
                            .map(String::as_str)
                            == Some(value))
            })
            .cloned()
            .collect();
        if found.len() >= want || tokio::time::Instant::now() > deadline {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn chat_request(addr: std::net::SocketAddr) -> http::request::Builder {
    post(addr, "/v1/chat/completions")
}

fn body() -> Full<Bytes> {
    Full::new(Bytes::from(chat_body(4, false)))
}

/// A chat completion asking for the pick explanation, with the admin token.
async fn debug_chat(addr: std::net::SocketAddr) -> Reply {
    let req = chat_request(addr)
        .header("x-rankgate-debug", "1")
        .header("x-rankgate-admin-token", TOKEN)
        .body(body())
        .unwrap();
    send(req).await
}

/// The `x-rankgate-pick` values of a reply, parsed.
fn picks(r: &Reply) -> Vec<Value> {
    (r.headers.get_all("x-rankgate-pick").iter())
        .map(|v| serde_json::from_slice(v.as_bytes()).expect("x-rankgate-pick is JSON"))
        .collect()
}

/// Engine A: ranks 0-1 at KV 0.5 and 0.1. Engine B: rank 2, whose telemetry leaves it out.
async fn fleet_with_a_dark_rank(
    server: &str,
    extra: &str,
) -> (SimEngine, SimEngine, rankgate::app::Router) {
    let a = engine(SimConfig {
        kv_usage: vec![0.5, 0.1],
        ..sim(rankgate_sim::sim::SimFlavor::Vllm, 2, 0)
    })
    .await;
    let b = engine(SimConfig {
        dark_ranks: vec![2],
        ..sim(rankgate_sim::sim::SimFlavor::Vllm, 1, 2)
    })
    .await;
    let r = router_with(
        server,
        &format!("{FAST}{extra}"),
        &[
            engine_toml(&a.url(), "vllm", 2, 0),
            engine_toml(&b.url(), "vllm", 1, 2),
        ],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows[..2]
            .iter()
            .all(|w| w["models"].as_array().is_some_and(|m| !m.is_empty()))
    })
    .await;
    (a, b, r)
}

#[tokio::test]
async fn debug_header_with_the_admin_token_explains_the_pick() {
    let (a, _b, r) = fleet_with_a_dark_rank(&token_env(), "").await;
    let reply = debug_chat(r.addr).await;
    assert_eq!(reply.status, StatusCode::OK);
    let picks = picks(&reply);
    assert_eq!(picks.len(), 1, "one attempt, one explanation");
    let x = &picks[0];
    assert_eq!(x["policy"], "least_kv");
    assert_eq!(x["by"], "kv");
    assert_eq!(x["picked"], reply.worker().as_str());
    let a1 = format!("{}@1", a.url());
    assert_eq!(x["picked"], a1.as_str(), "the rank with the least KV");
    let cands = x["candidates"].as_array().unwrap();
    assert_eq!(cands.len(), 2, "{x}");
    assert_eq!(cands[0]["worker"], a1.as_str(), "best first: {x}");
    let (s0, s1) = (
        cands[0]["score"].as_f64().unwrap(),
        cands[1]["score"].as_f64().unwrap(),
    );
    assert!(s0 < s1 && (0.05..0.2).contains(&s0) && s1 >= 0.5, "{x}");
    let skipped = x["skipped"].as_array().unwrap();
    assert_eq!(skipped.len(), 1, "{x}");
    assert!(
        skipped[0]["worker"].as_str().unwrap().ends_with("@2"),
        "{x}"
    );
    assert!(
        skipped[0]["why"]
            .as_str()
            .unwrap()
            .starts_with("telemetry: "),
        "{x}"
    );
    assert_eq!(x["not_serving"], 0);

    // The debugging headers, and the admin token above all, never reach the engine.
    let seen = a.seen();
    let last = seen.last().expect("the engine served it");
    for h in ["x-rankgate-admin-token", "x-rankgate-debug"] {
        assert!(
            !last.header_names.iter().any(|n| n == h),
            "{h} reached the engine"
        );
    }

    // Without the header there is no explanation.
    let plain = send(chat_request(r.addr).body(body()).unwrap()).await;
    assert_eq!(plain.status, StatusCode::OK);
    assert!(plain.headers.get("x-rankgate-pick").is_none());
    r.shutdown().await;
}

#[tokio::test]
async fn debug_header_refusals_are_named() {
    let (_a, _b, r) = fleet_with_a_dark_rank(&token_env(), "").await;
    let ask = |token: Option<&str>, value: &str| {
        let mut b = chat_request(r.addr).header("x-rankgate-debug", value);
        if let Some(t) = token {
            b = b.header("x-rankgate-admin-token", t);
        }
        send(b.body(body()).unwrap())
    };
    for (token, value, status, says) in [
        (None, "1", 401, "x-rankgate-admin-token"),
        (Some("wrong"), "1", 401, "invalid admin token"),
        (Some(TOKEN), "yes", 400, "takes the value 1"),
    ] {
        let reply = ask(token, value).await;
        assert_eq!(reply.status.as_u16(), status, "{token:?} {value}");
        let msg = reply.json()["error"]["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(msg.contains(says), "{msg}");
        assert!(reply.headers.get("x-rankgate-pick").is_none());
    }
    r.shutdown().await;

    // A router without an admin token has debugging off, and says how to turn it on.
    let (_a, _b, r) = fleet_with_a_dark_rank("", "").await;
    let reply = debug_chat(r.addr).await;
    assert_eq!(reply.status, StatusCode::FORBIDDEN);
    let msg = reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(msg.contains("server.admin_token_env"), "{msg}");
    r.shutdown().await;
}

#[tokio::test]
async fn a_retried_request_explains_every_attempt() {
    // A is the idlest but answers 503 to everything; B takes the retry.
    let a = engine(SimConfig {
        kv_usage: vec![0.0],
        fail_status: 503,
        fail_percent: 100.0,
        ..sim(rankgate_sim::sim::SimFlavor::Vllm, 1, 0)
    })
    .await;
    let b = engine(SimConfig {
        kv_usage: vec![0.4],
        ..sim(rankgate_sim::sim::SimFlavor::Vllm, 1, 1)
    })
    .await;
    let r = router_with(
        &token_env(),
        FAST,
        &[
            engine_toml(&a.url(), "vllm", 1, 0),
            engine_toml(&b.url(), "vllm", 1, 1),
        ],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    let reply = debug_chat(r.addr).await;
    assert_eq!(reply.status, StatusCode::OK);
    let picks = picks(&reply);
    assert_eq!(picks.len(), 2, "{picks:?}");
    let (wa, wb) = (format!("{}@0", a.url()), format!("{}@1", b.url()));
    assert_eq!(picks[0]["picked"], wa.as_str());
    assert_eq!(picks[1]["picked"], wb.as_str());
    let skipped = &picks[1]["skipped"][0];
    assert_eq!(skipped["worker"], wa.as_str(), "{}", picks[1]);
    assert!(
        skipped["why"]
            .as_str()
            .unwrap()
            .contains("failed an earlier attempt"),
        "{}",
        picks[1]
    );
    r.shutdown().await;
}

#[tokio::test]
async fn no_rank_is_explained_too() {
    let (_a, _b, r) =
        fleet_with_a_dark_rank(&token_env(), "[routing]\nno_telemetry = \"reject\"\n").await;
    // Every rank of engine A goes dark: no rank has telemetry, and the router rejects.
    _a.set_dark_ranks(vec![0, 1]);
    wait_state(&r, &[0, 1], "unavailable").await;
    let reply = debug_chat(r.addr).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    let picks = picks(&reply);
    assert_eq!(picks.len(), 1);
    assert!(picks[0]["picked"].is_null(), "{}", picks[0]);
    assert_eq!(picks[0]["candidates"].as_array().unwrap().len(), 0);
    let skipped = picks[0]["skipped"].as_array().unwrap();
    assert_eq!(
        skipped.len(),
        3,
        "every rank, with its reason: {}",
        picks[0]
    );
    assert!(skipped
        .iter()
        .all(|s| s["why"].as_str().unwrap().starts_with("telemetry: ")));
    r.shutdown().await;
}

#[tokio::test]
async fn request_and_upstream_spans_carry_the_pick_and_continue_the_trace() {
    capture_spans();
    let (a, _b, r) = fleet_with_a_dark_rank("", "").await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let reply = send(
        chat_request(r.addr)
            .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
            .body(body())
            .unwrap(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let request_id = reply.headers["x-request-id"].to_str().unwrap().to_string();

    let requests = spans("request", "request_id", &request_id, 1).await;
    assert_eq!(requests.len(), 1, "one request span");
    let f = &requests[0].fields;
    assert_eq!(f["trace_id"], trace_id);
    assert_eq!(f["worker"], reply.worker());
    assert_eq!(f["http.response.status_code"], "200");
    assert_eq!(f["attempts"], "1");
    assert_eq!(f["model"], "tiny-llama");
    assert_eq!(f["pick.policy"], "least_kv");
    let a1 = format!("{}@1", a.url());
    assert!(f["pick.candidates"].starts_with(&format!("{a1}=")), "{f:?}");
    assert!(
        f["pick.candidates"].contains(&format!("{}@0=", a.url())),
        "{f:?}"
    );
    assert!(f["pick.skipped"].contains("@2: telemetry: "), "{f:?}");

    let upstream = spans("upstream", "request_id", &request_id, 1).await;
    assert_eq!(upstream.len(), 1, "one attempt");
    let u = &upstream[0];
    assert_eq!(u.fields["worker"], a1);
    assert_eq!(u.fields["http.response.status_code"], "200");
    assert!(u.fields["pick.candidates"].starts_with(&format!("{a1}=")));

    // The engine joined the client's trace.
    let seen = a.seen();
    let tp = (seen.iter())
        .find(|s| s.request_id.as_deref() == Some(request_id.as_str()))
        .and_then(|s| s.traceparent.clone())
        .expect("the engine got a traceparent");
    assert_eq!(&tp[3..35], trace_id);
    r.shutdown().await;
}

#[tokio::test]
async fn a_request_the_client_abandons_ends_its_spans_as_cancelled() {
    capture_spans();
    let e = engine(SimConfig {
        hang_requests: true,
        ..sim(rankgate_sim::sim::SimFlavor::Vllm, 1, 0)
    })
    .await;
    let r = router(FAST, &[engine_toml(&e.url(), "vllm", 1, 0)]).await;
    wait_state(&r, &[0], "available").await;
    let req = chat_request(r.addr)
        .header("x-request-id", "abandoned-1")
        .body(body())
        .unwrap();
    // The engine never answers; the client gives up once the engine has the request.
    let call = tokio::spawn(async move { client().request(req).await });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while e.open_requests() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the request never reached the engine"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    call.abort();
    let _ = call.await;
    for name in ["request", "upstream"] {
        let found = spans(name, "request_id", "abandoned-1", 1).await;
        assert_eq!(found.len(), 1, "{name}");
        let f = &found[0].fields;
        assert_eq!(
            f.get("error").map(String::as_str),
            Some("cancelled: the client went away"),
            "{name}: {f:?}"
        );
        assert_eq!(
            f.get("otel.status_code").map(String::as_str),
            Some("ERROR"),
            "{name}"
        );
    }
    r.shutdown().await;
}
