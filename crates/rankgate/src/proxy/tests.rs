//! The layers, one by one and stacked, driven with `oneshot` against a mock upstream: no sockets.

use crate::ix::{Ix, WorkerIx};
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::BodyExt;
use std::time::Duration;
use tokio::time::Instant;
use tower::{service_fn, Service, ServiceExt};

use super::*;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::table::{Snapshot, Table};
use crate::worker::Fleet;

/// A router's layers and one connection's handle, over two vLLM engines, one rank each, both
/// with fresh telemetry showing them idle.
struct Fixture {
    layers: Arc<Layers>,
    ctx: Ctx,
}

impl std::ops::Deref for Fixture {
    type Target = Ctx;
    fn deref(&self) -> &Ctx {
        &self.ctx
    }
}

fn shared(extra: &str) -> Fixture {
    shared_with_keys(extra, None)
}

fn shared_with_keys(extra: &str, keys: Option<Keys>) -> Fixture {
    let text = format!(
        "{extra}\n[[engines]]\nurl = \"http://127.0.0.1:1\"\nflavor = \"vllm\"\ndp_size = 1\n\
         [[engines]]\nurl = \"http://127.0.0.1:2\"\nflavor = \"vllm\"\nstart_rank = 1\n"
    );
    let cfg = Config::from_str(&text).unwrap();
    let table = Table::new(
        Fleet::expand(cfg.engines.clone()),
        cfg.telemetry.stale_after,
    );
    let view = crate::table::test_view(0.1, Instant::now());
    let snap = table.snapshot.load();
    let (fleet, catalog) = (snap.fleet.clone(), snap.catalog.clone());
    table.snapshot.store(Arc::new(Snapshot {
        fleet,
        ranks: vec![view.clone(), view].into(),
        catalog,
    }));
    let metrics = Arc::new(Metrics::new());
    let layers = Layers::new(
        &cfg,
        table,
        metrics,
        keys,
        crate::tls::Upstream::system(),
        Default::default(),
    );
    let ctx = Ctx::new(layers.shared(), ([127, 0, 0, 1], 9).into(), Front::Http);
    Fixture { layers, ctx }
}

fn chat() -> Request<RequestBody> {
    Request::post("/v1/chat/completions")
        .body(RequestBody::Full(Bytes::from_static(b"{\"messages\":[]}")))
        .unwrap()
}

fn answer(status: u16) -> Response<ProxyBody> {
    let mut r = Response::new(ProxyBody::from(Bytes::from_static(b"{}")));
    *r.status_mut() = StatusCode::from_u16(status).unwrap();
    r
}

fn target(req: &Request<Picked>) -> Target {
    req.body().target.clone()
}

/// Worker `w` of the context's fleet (one rank per engine: `w` is also its engine and rank).
fn member(s: &Fixture, w: usize) -> Arc<crate::worker::Member> {
    s.table.snapshot.load().fleet.workers[WorkerIx::new(w)]
        .member
        .clone()
}

/// The index of a target's engine (= its worker's, in these one-rank engines).
fn engine(t: &Target) -> u32 {
    t.worker.id.rank.unwrap_or(0)
}

#[tokio::test]
async fn route_answers_404_and_405_and_passes_the_rest() {
    let inner = service_fn(|_: Request<()>| async { Ok::<_, ProxyError>(answer(200)) }).boxed();
    let s = shared("");
    let mut route = s.layers.route(inner, &s);
    let get = |p: &str| Request::get(p).body(()).unwrap();
    let e = route.call(get("/v2/nothing")).await.unwrap_err();
    assert_eq!(e.status(), StatusCode::NOT_FOUND);
    let e = route.call(get("/v1/chat/completions")).await.unwrap_err();
    assert_eq!(e.status(), StatusCode::METHOD_NOT_ALLOWED);
    let ok = route.call(get("/get_server_info")).await;
    assert_eq!(
        ok.unwrap_err().status(),
        StatusCode::NOT_FOUND,
        "an SGLang route in a vLLM fleet"
    );
    let post = |p: &str| Request::post(p).body(()).unwrap();
    assert_eq!(route.call(post("/tokenize")).await.unwrap().status(), 200);
    // The fleet's own model list is rankgate's answer, not an engine's.
    let models = route.call(get("/v1/models")).await.unwrap();
    let body = models.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["object"], "list");
}

#[tokio::test]
async fn admission_counts_until_the_body_ends() {
    let s = shared("[server]\nmax_in_flight = 1\n");
    let inner = service_fn(|_: Request<()>| async { Ok::<_, ProxyError>(answer(200)) }).boxed();
    let mut admit = s.layers.admit(inner);
    let held = admit.call(Request::new(())).await.unwrap();
    let e = admit.call(Request::new(())).await.unwrap_err();
    assert_eq!(e.status(), StatusCode::TOO_MANY_REQUESTS);
    // The slot is freed when the first response's body ends, not when its headers went out.
    held.into_body().collect().await.unwrap();
    assert!(admit.call(Request::new(())).await.is_ok());
}

#[tokio::test]
async fn a_client_address_past_its_streams_gets_429_and_another_does_not() {
    let s = shared("[server]\nmax_streams_per_client = 1\n");
    let inner = || service_fn(|_: Request<()>| async { Ok::<_, ProxyError>(answer(200)) }).boxed();
    let mut respond = s.layers.respond(inner(), &s.ctx);
    let held = respond.call(Request::new(())).await.unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    let refused = respond.call(Request::new(())).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("in flight from this address"), "{text}");
    // Another address's connection is counted apart.
    let other = Ctx::new(s.layers.shared(), ([127, 0, 0, 2], 9).into(), Front::Http);
    let mut theirs = s.layers.respond(inner(), &other);
    assert_eq!(
        theirs.call(Request::new(())).await.unwrap().status(),
        StatusCode::OK
    );
    // rankgate's own answers are no engine's streams: served at the cap.
    let models = Request::get("/v1/models").body(()).unwrap();
    assert_eq!(respond.call(models).await.unwrap().status(), StatusCode::OK);
    // The count goes down when the held answer's body ends, not before.
    assert_eq!(
        respond.call(Request::new(())).await.unwrap().status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    held.into_body().collect().await.unwrap();
    assert_eq!(
        respond.call(Request::new(())).await.unwrap().status(),
        StatusCode::OK
    );
}

#[tokio::test]
async fn respond_turns_errors_into_openai_answers() {
    // Told in full: by default the worker and the setting are not named (see `exposure`).
    let s = shared("[server]\nexpose_worker = \"url\"\n");
    let on = member(&s, 1);
    let inner = service_fn(move |_: Request<()>| {
        let e = ProxyError::Timeout(Duration::from_millis(5)).at(&on);
        async move { Err::<Response<ProxyBody>, _>(e) }
    })
    .boxed();
    let resp = s
        .layers
        .respond(inner, &s)
        .oneshot(Request::new(()))
        .await
        .unwrap_or_else(|e: Infallible| match e {});
    assert_eq!(resp.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(resp.headers()[WORKER_HEADER], "http://127.0.0.1:2@1");
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], 504);
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("server.response_timeout") && msg.contains("@1"),
        "{msg}"
    );
}

#[tokio::test]
async fn auth_refuses_without_a_key_and_passes_with_one_or_when_none_is_configured() {
    let inner = || service_fn(|_: Request<()>| async { Ok::<_, ProxyError>(answer(200)) }).boxed();
    let with_auth = |v: Option<&'static str>| {
        let mut r = Request::new(());
        if let Some(v) = v {
            r.headers_mut()
                .insert(http::header::AUTHORIZATION, HeaderValue::from_static(v));
        }
        r
    };
    let open = shared("");
    let ok = open.layers.auth(inner()).oneshot(with_auth(None)).await;
    assert_eq!(ok.unwrap().status(), 200);

    let gated = shared_with_keys("", Some(Keys::new(&["sk-1"])));
    let e = gated
        .layers
        .auth(inner())
        .oneshot(with_auth(None))
        .await
        .unwrap_err();
    assert_eq!(e.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(e.kind(), "AuthenticationError");
    let ok = gated
        .layers
        .auth(inner())
        .oneshot(with_auth(Some("Bearer sk-1")))
        .await;
    assert_eq!(ok.unwrap().status(), 200);
}

#[tokio::test]
async fn the_outer_layers_mark_rankgates_own_refusals() {
    let s = shared_with_keys(
        "[server]\ncors_allow_origins = [\"https://a.test\"]\n",
        Some(Keys::new(&["sk-1"])),
    );
    let inner = service_fn(|_: Request<()>| async { Ok::<_, ProxyError>(answer(200)) }).boxed();
    let l = &s.layers;
    let stack = l.identity(l.cors(l.respond(l.auth(inner), &s), &s), &s);
    let mut req = Request::new(());
    req.headers_mut().insert(
        http::header::ORIGIN,
        HeaderValue::from_static("https://a.test"),
    );
    let resp = stack
        .oneshot(req)
        .await
        .unwrap_or_else(|e: Infallible| match e {});
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    let h = resp.headers();
    assert_eq!(h[http::header::WWW_AUTHENTICATE], "Bearer");
    assert_eq!(
        h[http::header::ACCESS_CONTROL_ALLOW_ORIGIN],
        "https://a.test"
    );
    assert_eq!(h[identity::REQUEST_ID].len(), 32);
}

/// retry → pick → observe over a mock `send` that answers per engine.
fn failover_stack(
    s: &Fixture,
    answer_for: impl Fn(Target) -> Result<Response<ProxyBody>, ProxyError> + Clone + Send + 'static,
    calls: Arc<AtomicUsize>,
) -> impl Service<Request<RequestBody>, Response = Response<ProxyBody>, Error = ProxyError> {
    let send = service_fn(move |req: Request<Picked>| {
        calls.fetch_add(1, Relaxed);
        let picked = req.into_body();
        // As `send` does: the response carries its rank and holds the in-flight mark.
        let r = answer_for(picked.target.clone()).map(|mut resp| {
            resp.body_mut().target = Some(picked.target);
            resp.body_mut().holds.in_flight = Some(picked.guard);
            resp
        });
        async move { r }
    })
    .boxed_clone();
    let l = &s.layers;
    l.retry(l.pick(l.observe(send, s), s), s)
}

#[tokio::test]
async fn a_503_is_retried_on_the_other_rank_and_the_failing_rank_is_ejected() {
    let s = shared("[routing]\neject_after = 1\neject_for = \"10s\"\n");
    let calls = Arc::new(AtomicUsize::new(0));
    let stack = failover_stack(
        &s,
        |t| Ok(answer(if engine(&t) == 0 { 503 } else { 200 })),
        calls.clone(),
    );
    let mut stack = stack;
    for _ in 0..20 {
        let resp = stack.ready().await.unwrap().call(chat()).await.unwrap();
        assert_eq!(resp.status(), 200, "every request ends on the healthy rank");
        assert_eq!(engine(resp.body().target.as_ref().unwrap()), 1);
    }
    let live = &member(&s, 0).live.outlier;
    let e = live
        .ejection()
        .expect("a 503 ejects the rank (eject_after = 1)");
    assert!(
        e.to_string().starts_with("ejected: 1 consecutive 503"),
        "{e}"
    );
    // Only the failure that ejected it reached the broken rank.
    assert!(calls.load(Relaxed) <= 21, "{}", calls.load(Relaxed));
    assert_eq!(s.metrics.retries_total(), calls.load(Relaxed) as u64 - 20);
}

#[tokio::test]
async fn failures_weigh_on_the_score_before_ejection() {
    let s = shared("[routing]\neject_after = 5\n");
    let calls = Arc::new(AtomicUsize::new(0));
    let mut stack = failover_stack(
        &s,
        |t| Ok(answer(if engine(&t) == 0 { 503 } else { 200 })),
        calls.clone(),
    );
    let mut held = Vec::new();
    for _ in 0..10 {
        held.push(stack.ready().await.unwrap().call(chat()).await.unwrap());
    }
    // Both ranks look equally idle, yet one failure sends the rest to the healthy rank: a rank
    // that fails fast never looks like the idlest one.
    assert!(calls.load(Relaxed) <= 11, "{}", calls.load(Relaxed));
    assert_eq!(
        member(&s, 0).live.outlier.failures(),
        calls.load(Relaxed) as u32 - 10
    );
}

#[tokio::test]
async fn a_transport_failure_avoids_the_whole_engine_and_4xx_never_counts() {
    let s = shared("");
    let calls = Arc::new(AtomicUsize::new(0));
    let mut stack = failover_stack(
        &s,
        |t| match engine(&t) {
            0 => Err(ProxyError::Upstream {
                engine: "http://127.0.0.1:1".into(),
                reason: "connection refused".into(),
            }),
            _ => Ok(answer(400)),
        },
        calls.clone(),
    );
    // Both ranks look alike, so ties are broken at random: send until the broken one was tried.
    for _ in 0..64 {
        let resp = stack.ready().await.unwrap().call(chat()).await.unwrap();
        assert_eq!(
            resp.status(),
            400,
            "the engine's own 4xx is the answer, not retried"
        );
        if member(&s, 0).live.outlier.failures() > 0 {
            break;
        }
    }
    assert_eq!(member(&s, 0).live.outlier.failures(), 1);
    assert_eq!(
        s.metrics.retries_total(),
        1,
        "the refused attempt went to the other engine"
    );
    assert_eq!(member(&s, 1).live.outlier.failures(), 0, "4xx never counts");
}

#[tokio::test]
async fn retries_stop_at_max_attempts_and_keep_the_engines_answer() {
    let s = shared("[routing]\nmax_attempts = 2\neject_after = 0\n");
    let calls = Arc::new(AtomicUsize::new(0));
    let mut stack = failover_stack(&s, |_| Ok(answer(503)), calls.clone());
    let resp = stack.ready().await.unwrap().call(chat()).await.unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(calls.load(Relaxed), 2, "one retry, on the other rank");
}

#[tokio::test]
async fn the_retry_budget_caps_extra_load_when_everything_fails() {
    let s = shared("[routing]\neject_after = 0\nretry_budget = 0.2\n");
    let calls = Arc::new(AtomicUsize::new(0));
    let mut stack = failover_stack(&s, |_| Ok(answer(503)), calls.clone());
    for _ in 0..200 {
        let resp = stack.ready().await.unwrap().call(chat()).await.unwrap();
        assert_eq!(resp.status(), 503);
    }
    let extra = calls.load(Relaxed) - 200;
    // 20% of 200 plus the floor (2 per second over a 10 s window).
    assert!(extra <= 40 + 20, "{extra} retries for 200 requests");
    assert!(extra >= 20, "some retries are allowed: {extra}");
}

#[tokio::test]
async fn pick_pins_the_rank_header_and_strips_the_clients_own() {
    let s = shared("");
    let send = service_fn(|req: Request<Picked>| async move {
        let t = target(&req);
        assert_eq!(req.headers()[RANK_HEADER], engine(&t).to_string());
        // Addressed to the picked engine: its Host, in origin form on its own connection.
        let host = req.headers()[http::header::HOST].to_str().unwrap();
        assert_eq!(format!("http://{host}"), *t.engine.url);
        assert_eq!(req.uri(), "/v1/chat/completions");
        assert!(
            Arc::ptr_eq(req.body().guard.member(), &t.worker),
            "in flight on its rank"
        );
        Ok::<_, ProxyError>(answer(200))
    })
    .boxed_clone();
    let mut req = chat();
    req.headers_mut()
        .insert(RANK_HEADER, HeaderValue::from_static("7"));
    let resp = s.layers.pick(send, &s).oneshot(req).await.unwrap();
    assert_eq!(resp.status(), 200);
}
