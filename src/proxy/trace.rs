//! Request tracing, right below `identity`: the W3C trace context continued (the client's trace,
//! with rankgate's hop as the parent the engine sees) or started, so an engine that traces (vLLM
//! `--otlp-traces-endpoint`) joins the client's trace; a `request` span per request, with the
//! pick (candidates, scores, ranks passed over and why) as attributes and an `upstream` child
//! span per attempt on an engine; and, for `x-rankgate-debug: 1` with the admin token, each
//! attempt's pick explanation in an `x-rankgate-pick` response header.
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

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response};
use tracing::field::Empty;
use tracing::Span;

use super::identity::hex_into;
use super::{Answer, Ctx, ProxyBody, ProxyError, REQUEST_ID};
use crate::policy::Explanation;
use crate::worker::{EngineEntry, Member};

pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");
/// `x-rankgate-debug: 1` asks for the pick explanation (with the admin token).
pub const DEBUG: HeaderName = HeaderName::from_static("x-rankgate-debug");
/// Where a debugging client sends the admin token (`Authorization` carries its API key).
pub const ADMIN_TOKEN: HeaderName = HeaderName::from_static("x-rankgate-admin-token");
/// The pick explanation, one value per attempt, in order.
pub const PICK: HeaderName = HeaderName::from_static("x-rankgate-pick");
/// Longest `x-rankgate-pick` value: within what clients and proxies accept for one header.
const MAX_PICK_HEADER: usize = 4096;

/// The trace context the request continues: what the engine is told, and what an exported span
/// is the child of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: u128,
    /// The client's span, when it sent a valid `traceparent`.
    pub parent: Option<u64>,
    /// rankgate's hop, the engine's parent.
    pub hop: u64,
    pub sampled: bool,
}

/// The trace id, parent id and flags of a valid `traceparent` (W3C Trace Context level 1):
/// version `00` exactly `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`, ids not all
/// zero, lowercase; a later version may append fields after the four it shares with `00`.
fn parse_traceparent(v: &[u8]) -> Option<(u128, u64, u8)> {
    let hex = |s: &[u8]| {
        s.iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    };
    if v.len() < 55 || !hex(&v[..2]) || &v[..2] == b"ff" || (&v[..2] == b"00" && v.len() != 55) {
        return None;
    }
    if v.len() > 55 && v[55] != b'-' {
        return None;
    }
    let (trace, parent, flags) = (&v[3..35], &v[36..52], &v[53..55]);
    let dashes = v[2] == b'-' && v[35] == b'-' && v[52] == b'-';
    if !dashes || !hex(trace) || !hex(parent) || !hex(flags) {
        return None;
    }
    let num = |s: &[u8]| u128::from_str_radix(std::str::from_utf8(s).ok()?, 16).ok();
    let (trace, parent, flags) = (num(trace)?, num(parent)?, num(flags)?);
    (trace != 0 && parent != 0).then_some((trace, parent as u64, flags as u8))
}

/// `traceparent` for `trace_id`, with `span` as the parent the receiver sees.
pub fn traceparent(trace_id: u128, span: u64, sampled: bool) -> HeaderValue {
    let mut v = [0u8; 55];
    v[..3].copy_from_slice(b"00-");
    let mut trace = [0u8; 32];
    hex_into(trace_id, &mut trace);
    v[3..35].copy_from_slice(&trace);
    v[35] = b'-';
    let mut parent = [0u8; 16];
    hex_into(u128::from(span), &mut parent);
    v[36..52].copy_from_slice(&parent);
    v[52..].copy_from_slice(if sampled { b"-01" } else { b"-00" });
    HeaderValue::from_bytes(&v).unwrap_or(HeaderValue::from_static(""))
}

/// Continues the client's trace with rankgate's own hop as the engine's parent, or starts one
/// (sampled, so a tracing engine records it). An invalid `traceparent` is replaced, and its
/// `tracestate` dropped with it, as the spec requires.
fn trace_context(h: &mut HeaderMap) -> TraceContext {
    let mut sent = h.get_all(&TRACEPARENT).iter();
    let valid = match (sent.next(), sent.next()) {
        (Some(v), None) => parse_traceparent(v.as_bytes()),
        _ => None,
    };
    let hop = rand::random::<u64>() | 1;
    let tc = match valid {
        Some((trace_id, parent, flags)) => TraceContext {
            trace_id,
            parent: Some(parent),
            hop,
            sampled: flags & 1 == 1,
        },
        None => {
            h.remove(&TRACESTATE);
            TraceContext {
                trace_id: rand::random::<u128>() | 1,
                parent: None,
                hop,
                sampled: true,
            }
        }
    };
    h.insert(TRACEPARENT, traceparent(tc.trace_id, tc.hop, tc.sampled));
    tc
}

/// What a traced (or debugged) request carries down the stack: its span, and where `pick`
/// writes its explanations for `x-rankgate-pick`.
#[derive(Clone)]
pub struct Traced {
    pub span: Span,
    picks: Option<Arc<Mutex<Vec<Explanation>>>>,
}

impl Traced {
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

/// Why `x-rankgate-debug` was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DebugRefused {
    #[error("x-rankgate-debug takes the value 1")]
    NotOne,
    #[error("x-rankgate-debug is off: set server.admin_token_env to the environment variable holding the admin token")]
    Off,
    #[error(
        "x-rankgate-debug needs the admin token: send it as `x-rankgate-admin-token: <token>`"
    )]
    Missing,
    #[error("x-rankgate-debug: invalid admin token")]
    Wrong,
}

/// Whether the request asks for debugging, and if so whether it may: `None` when it does not
/// ask, `Some(Ok)` when it asks with the admin token (for `auth`).
pub fn debug_allowed(ctx: &Ctx, h: &HeaderMap) -> Option<Result<(), DebugRefused>> {
    let asked = h.get(&DEBUG)?;
    Some((|| {
        if asked.as_bytes() != b"1" {
            return Err(DebugRefused::NotOne);
        }
        let token = ctx.debug_token.as_ref().ok_or(DebugRefused::Off)?;
        let sent = h.get(&ADMIN_TOKEN).ok_or(DebugRefused::Missing)?;
        match token.accepts(sent.as_bytes()) {
            true => Ok(()),
            false => Err(DebugRefused::Wrong),
        }
    })())
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

impl From<DebugRefused> for ProxyError {
    fn from(d: DebugRefused) -> ProxyError {
        ProxyError::Debug(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_valid_trace_is_continued_with_a_new_parent_and_an_invalid_one_replaced() {
        let client = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut h = HeaderMap::new();
        h.insert(TRACEPARENT, HeaderValue::from_static(client));
        h.insert(TRACESTATE, HeaderValue::from_static("congo=t61rcWkgMzE"));
        let tc = trace_context(&mut h);
        assert_eq!(tc.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(tc.parent, Some(0x00f067aa0ba902b7));
        assert!(tc.sampled);
        let v = h[&TRACEPARENT].to_str().unwrap().to_string();
        assert_eq!(&v[..36], &client[..36], "same version and trace id");
        assert_eq!(
            &v[36..52],
            format!("{:016x}", tc.hop),
            "rankgate's own hop is the parent"
        );
        assert_eq!(&v[52..], "-01");
        assert_eq!(h[&TRACESTATE], "congo=t61rcWkgMzE");
        assert!(parse_traceparent(v.as_bytes()).is_some());

        // Not sampled by the client: not sampled on.
        let mut h = HeaderMap::new();
        h.insert(
            TRACEPARENT,
            HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"),
        );
        assert!(!trace_context(&mut h).sampled);
        assert!(h[&TRACEPARENT].to_str().unwrap().ends_with("-00"));

        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "garbage",
        ] {
            let mut h = HeaderMap::new();
            h.insert(TRACEPARENT, HeaderValue::from_str(bad).unwrap());
            h.insert(TRACESTATE, HeaderValue::from_static("a=b"));
            let tc = trace_context(&mut h);
            let v = h[&TRACEPARENT].to_str().unwrap();
            assert_ne!(
                &v[3..35],
                bad.get(3..35).unwrap_or(""),
                "{bad}: a new trace"
            );
            assert_eq!(tc.parent, None, "{bad}");
            assert!(parse_traceparent(v.as_bytes()).is_some(), "{bad} -> {v}");
            assert!(
                !h.contains_key(&TRACESTATE),
                "{bad}: its tracestate goes with it"
            );
        }
        // A later version's extra fields are allowed.
        assert!(parse_traceparent(
            b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-later"
        )
        .is_some());
    }
}
