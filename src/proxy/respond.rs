//! Every error becomes an OpenAI-shaped response, every response is counted, and each request's
//! latency is recorded when its body ends. The outermost layer that can fail: only `identity`
//! and `cors` (which add headers, and answer preflights) run outside it.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::{header, HeaderValue, Request, Response, StatusCode};
use tokio::time::Instant;

use super::body::Done;
use super::{Answer, Ctx, ProxyBody, ProxyError, WORKER_HEADER};

#[derive(Clone)]
pub struct Respond<S> {
    inner: S,
    ctx: Ctx,
}

impl<S> Respond<S> {
    pub fn new(inner: S, ctx: &Ctx) -> Respond<S> {
        Respond {
            inner,
            ctx: ctx.clone(),
        }
    }
}

impl<S, B> tower::Service<Request<B>> for Respond<S>
where
    S: tower::Service<Request<B>, Response = Response<ProxyBody>, Error = ProxyError>,
    S::Future: Unpin,
{
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Responding<S::Future>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Every layer below is always ready: admission is decided per request, as a 429.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        Responding {
            started: Instant::now(),
            inner: self.inner.call(req),
            ctx: self.ctx.clone(),
        }
    }
}

/// The answer of the layers below, turned into the client's response. A future of its own
/// rather than a boxed `async` block: this is one allocation less on every request.
pub struct Responding<F> {
    inner: F,
    started: Instant,
    ctx: Ctx,
}

impl<F: Future<Output = Answer> + Unpin> Future for Responding<F> {
    type Output = Result<Response<ProxyBody>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        Poll::Ready(Ok(match ready!(Pin::new(&mut this.inner).poll(cx)) {
            Ok(mut resp) => {
                if let Some(t) = &resp.body().target {
                    this.ctx.metrics.response(&t.worker, resp.status().as_u16());
                }
                resp.body_mut().holds.done = Some(Done {
                    started: this.started,
                    ctx: this.ctx.clone(),
                });
                resp
            }
            Err(e) => error_response(&this.ctx, &e),
        }))
    }
}

/// The client's answer to `err` (also for `cors`' refusals, made outside this layer).
pub(super) fn error_response(ctx: &Ctx, err: &ProxyError) -> Response<ProxyBody> {
    let status = err.status();
    let metrics = &ctx.metrics;
    let message = match err.worker() {
        Some(w) => {
            metrics.response(w, status.as_u16());
            format!("{}: {err}", w.id_text)
        }
        None => {
            metrics.own_response(status.as_u16());
            err.to_string()
        }
    };
    if status.is_server_error() {
        if let Some(held) = ctx.storm.allow() {
            tracing::warn!(status = status.as_u16(), error = ?message, similar_since_last = held, "request failed");
        }
    } else {
        tracing::debug!(status = status.as_u16(), error = ?message, "request refused");
    }
    if ctx.grpc() {
        let mut resp = super::grpc::status_response(super::grpc::code_of(err), &message);
        if let ProxyError::Grpc(super::GrpcError { http: Some(s), .. }) = err.root() {
            *resp.status_mut() = *s;
        }
        if let Some(w) = err.worker() {
            resp.headers_mut().insert(WORKER_HEADER, w.header.clone());
        }
        return resp;
    }
    let (param, code) = err.param_and_code();
    let body = crate::http::error_json_with(err.kind(), &message, param, code);
    let mut resp: Response<ProxyBody> = crate::http::respond(status, "application/json", body);
    if matches!(
        status,
        StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
    ) {
        resp.headers_mut()
            .insert(header::RETRY_AFTER, ctx.retry_after.clone());
    }
    if status == StatusCode::UNAUTHORIZED {
        // RFC 6750: a 401 names the scheme the client should use.
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    if let ProxyError::MethodNotAllowed { allow, .. } = err.root() {
        if let Ok(v) = HeaderValue::from_str(allow.as_str()) {
            resp.headers_mut().insert(header::ALLOW, v);
        }
    }
    if let Some(w) = err.worker() {
        resp.headers_mut().insert(WORKER_HEADER, w.header.clone());
    }
    resp
}
