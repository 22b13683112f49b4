//! Request tracing, right below `identity`: the W3C trace context continued (the client's trace,
//! with rankgate's hop as the parent the engine sees) or started, so an engine that traces (vLLM
//! `--otlp-traces-endpoint`) joins the client's trace; a `request` span per request, with the
//! pick (candidates, scores, ranks passed over and why) as attributes and an `upstream` child
//! span per attempt on an engine; and, for `x-rankgate-debug: 1` with the admin token, each
//! attempt's pick explanation in an `x-rankgate-pick` response header, and the rank that
//! answered in `x-rankgate-worker` under any `server.expose_worker`.
//!
//! The spans are at target `rankgate::trace`, which the log filter leaves off unless `RUST_LOG`
//! names it (then they print when they close) and OTLP export turns on. A request nobody
//! traces or debugs costs the trace-context rewrite (two random numbers and the new header
//! value) and a header lookup here and in `auth`: its span is disabled, no explanation is
//! built.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};

use http::header::{HeaderName, HeaderValue};
use http::{Request, Response};
use tracing::field::Empty;
use tracing::Span;

use super::body::ProxyBody;
use super::identity::REQUEST_ID;
use super::layer::Answer;
use super::shared::Ctx;
use crate::policy::Explanation;
use crate::tracecontext::trace_context;
use crate::worker::{EngineEntry, Member};

/// `x-rankgate-debug: 1` asks for the pick explanation (with the admin token).
pub const DEBUG: HeaderName = HeaderName::from_static("x-rankgate-debug");
/// Where a debugging client sends the admin token (`Authorization` carries its API key).
pub const ADMIN_TOKEN: HeaderName = HeaderName::from_static("x-rankgate-admin-token");
/// The pick explanation, one value per attempt, in order.
pub const PICK: HeaderName = HeaderName::from_static("x-rankgate-pick");
/// Longest `x-rankgate-pick` value: within what clients and proxies accept for one header.
const MAX_PICK_HEADER: usize = 4096;

/// What a traced (or debugged) request carries down the stack: its span, and where `pick`
/// writes its explanations for `x-rankgate-pick`.
#[derive(Clone)]
pub struct Traced {
    pub span: Span,
    picks: Option<Arc<Mutex<Vec<Explanation>>>>,
}

impl Traced {
    /// The request asked for its pick explanations (`x-rankgate-debug`).
    pub fn debugged(&self) -> bool {
        self.picks.is_some()
    }

    /// Notes a pick (or a failure to pick) on the request's span and for the debug header;
    /// returns the span of the attempt it starts, if it found a rank.
    pub fn picked(
        &self,
        x: &Explanation,
        target: Option<(&Member, &EngineEntry, bool)>,
    ) -> Option<Span> {
        record_pick(&self.span, x);
        if let Some(picks) = &self.picks {
            if let Ok(mut p) = picks.lock() {
                p.push(x.clone());
            }
        }
        let (worker, engine, trial) = target?;
        self.span.record("worker", &*worker.id_text);
        let attempt = tracing::info_span!(
            target: "rankgate::trace",
            parent: &self.span,
            "upstream",
            otel.kind = "client",
            otel.status_code = Empty,
            worker = &*worker.id_text,
            engine = %engine.url,
            trial,
            http.response.status_code = Empty,
            error = Empty,
            pick.policy = Empty,
            pick.by = Empty,
            pick.candidates = Empty,
            pick.skipped = Empty,
            pick.not_serving = Empty,
        );
        record_pick(&attempt, x);
        Some(attempt)
    }
}

fn record_pick(span: &Span, x: &Explanation) {
    if span.is_disabled() {
        return;
    }
    span.record("pick.policy", x.policy);
    span.record("pick.by", x.by.as_str());
    span.record("pick.candidates", x.candidates_text());
    span.record("pick.skipped", x.skipped_text());
    span.record("pick.not_serving", x.not_serving);
}

/// Why a span ends without an answer: its future was dropped.
const GONE: &str = "cancelled: the client went away";

/// Marks `span` as cancelled unless disarmed: an attempt's future dropped mid-way (the client
/// left) still ends with an outcome.
struct Unfinished(Option<Span>);

impl Drop for Unfinished {
    fn drop(&mut self) {
        if let Some(span) = self.0.take() {
            span.record("error", GONE);
            span.record("otel.status_code", "ERROR");
        }
    }
}

/// Runs an attempt inside its span and notes how it ended.
pub async fn attempt<F: Future<Output = Answer>>(span: Span, fut: F) -> Answer {
    use tracing::Instrument;
    let mut unfinished = Unfinished(Some(span.clone()));
    let answer = fut.instrument(span.clone()).await;
    unfinished.0 = None;
    match &answer {
        Ok(resp) => {
            let status = resp.status().as_u16();
            span.record("http.response.status_code", status);
            if status >= 500 {
                span.record("otel.status_code", "ERROR");
            }
        }
        Err(e) => {
            span.record("error", tracing::field::display(e));
            span.record("otel.status_code", "ERROR");
        }
    }
    answer
}

#[derive(Clone)]
pub struct Trace<S> {
    inner: S,
    ctx: Ctx,
}

impl<S> Trace<S> {
    pub fn new(inner: S, ctx: &Ctx) -> Trace<S> {
        Trace {
            inner,
            ctx: ctx.clone(),
        }
    }
}

impl<S, B> tower::Service<Request<B>> for Trace<S>
where
    S: tower::Service<Request<B>, Response = Response<ProxyBody>, Error = Infallible>,
    S::Future: Unpin,
{
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Tracing<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let context = trace_context(req.headers_mut());
        let debug = req.headers().get(&DEBUG).is_some_and(|v| v == "1");
        let span = tracing::info_span!(
            target: "rankgate::trace",
            "request",
            otel.kind = "server",
            otel.name = Empty,
            otel.status_code = Empty,
            error = Empty,
            http.request.method = %req.method(),
            url.path = req.uri().path(),
            request_id = Empty,
            trace_id = Empty,
            model = Empty,
            worker = Empty,
            attempts = Empty,
            http.response.status_code = Empty,
            pick.policy = Empty,
            pick.by = Empty,
            pick.candidates = Empty,
            pick.skipped = Empty,
            pick.not_serving = Empty,
        );
        if span.is_disabled() && !debug {
            return Tracing {
                inner: self.inner.call(req),
                span: None,
                picks: None,
                ctx: None,
            };
        }
        if !span.is_disabled() {
            span.record(
                "otel.name",
                format!("{} {}", req.method(), req.uri().path()),
            );
            if let Some(id) = req.headers().get(&REQUEST_ID).and_then(|v| v.to_str().ok()) {
                span.record("request_id", id);
            }
            #[cfg(feature = "otlp")]
            let trace_id = crate::otlp::continue_trace(&span, &context);
            #[cfg(not(feature = "otlp"))]
            let trace_id = context.trace_id;
            span.record("trace_id", format!("{trace_id:032x}"));
        }
        let picks = debug.then(Arc::default);
        req.extensions_mut().insert(Traced {
            span: span.clone(),
            picks: picks.clone(),
        });
        let inner = {
            let _in = span.enter();
            self.inner.call(req)
        };
        Tracing {
            inner,
            span: Some(span),
            picks,
            ctx: Some(self.ctx.clone()),
        }
    }
}

/// The answer below, inside the request's span; the span ends with the response body (or,
/// marked cancelled, when the client leaves before the answer).
pub struct Tracing<F> {
    inner: F,
    span: Option<Span>,
    picks: Option<Arc<Mutex<Vec<Explanation>>>>,
    /// Only for a traced request (names its model).
    ctx: Option<Ctx>,
}

impl<F> Future for Tracing<F>
where
    F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Unpin,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let Some(span) = &this.span else {
            return Pin::new(&mut this.inner).poll(cx);
        };
        let mut resp = {
            let _in = span.enter();
            ready!(Pin::new(&mut this.inner).poll(cx))?
        };
        let status = resp.status().as_u16();
        span.record("http.response.status_code", status);
        span.record("attempts", resp.body().holds.attempts);
        if let (Some(ctx), Some(done)) = (&this.ctx, &resp.body().holds.done) {
            span.record("model", ctx.metrics.model_name(done.model));
        }
        if status >= 500 {
            span.record("otel.status_code", "ERROR");
        }
        if let Some(picks) = this.picks.take() {
            // The admin token was checked (`auth`): the rank that answered is named in full
            // whatever `server.expose_worker` tells clients, so an operator's tools can say it.
            if let Some(t) = &resp.body().target {
                let v = t.worker.header.clone();
                resp.headers_mut().insert(super::layer::WORKER_HEADER, v);
            }
            let picks = picks.lock().map(|p| p.clone()).unwrap_or_default();
            for x in picks {
                if let Ok(v) = HeaderValue::from_str(&x.to_json(MAX_PICK_HEADER)) {
                    resp.headers_mut().append(PICK, v);
                }
            }
        }
        resp.body_mut().holds.span = this.span.take().map(Box::new);
        Poll::Ready(Ok(resp))
    }
}

impl<F> Drop for Tracing<F> {
    fn drop(&mut self) {
        // Still here: dropped before the answer came.
        if let Some(span) = self.span.take() {
            span.record("error", GONE);
            span.record("otel.status_code", "ERROR");
        }
    }
}
