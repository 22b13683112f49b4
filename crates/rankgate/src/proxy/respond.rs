//! Every error becomes an OpenAI-shaped response, every response is counted, and each request's
//! latency is recorded when its body ends. The outermost layer that can fail: only `identity`,
//! `trace` and `cors` (which add headers, and answer preflights) run outside it.
//!
//! It also counts each request an engine serves against its client address's
//! `server.max_streams_per_client` until the answer's body ends, and answers 429 past it before
//! anything below runs (peers in `server.trusted_proxies` carry many clients' requests and are
//! not held to it; rankgate's own answers, a gRPC `Abort` above all, are not counted): one
//! address must not hold more of the fleet than a share well below what one engine can take. Here
//! rather than in `admit`, so that the count rides in this layer's future and answer, which
//! every request has anyway: a future of its own in `admit` cost about 300 instructions per
//! request (bench/instructions.sh).
//!
//! A request's labels are resolved here, before anything below runs: its route from its path,
//! its model from the catalog when the fleet serves one model. Where the fleet routes by model,
//! `select` reads the model from the body anyway, and writes its label to a slot this layer
//! reads back with the answer, whatever the answer (so a 503 for a model with no rank still
//! names the model).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use http::{header, HeaderValue, Request, Response, StatusCode};
use tokio::time::Instant;

use super::body::ProxyBody;
use super::error::ProxyError;
use super::exposure::Exposure;
use super::guards::{Access, ClientStream, Done};
use super::layer::{Answer, WORKER_HEADER};
use super::shared::Ctx;
use crate::http::Throttle;
use crate::metrics::{ModelSlot, RequestLabels};

#[derive(Clone)]
pub struct Respond<S> {
    inner: S,
    ctx: Ctx,
    errors: Arc<Errors>,
}

/// How errors are answered and logged, one for the router.
#[derive(Debug)]
pub struct Errors {
    /// One log line per few seconds for server-side errors, however many requests hit them.
    storm: Throttle,
    /// `routing.retry_after_secs`, on every 503 and 429.
    retry_after: HeaderValue,
    /// `server.access_log`: a line per request.
    access_log: bool,
    /// `server.expose_worker`: what the answer tells of the engine.
    exposure: Exposure,
}

impl Errors {
    /// `server.access_log`: whether requests that end without an answer (`disagg`) log too.
    pub fn access_log(&self) -> bool {
        self.access_log
    }
}

impl Errors {
    pub fn new(access_log: bool, retry_after_secs: u32, exposure: Exposure) -> Errors {
        Errors {
            storm: Throttle::new(Duration::from_secs(5)),
            retry_after: HeaderValue::from(retry_after_secs),
            access_log,
            exposure,
        }
    }
}

/// An error as the logs write it: the worker's full id and every detail, whatever clients are
/// told. Written only when a line is logged.
struct Logged<'a>(&'a ProxyError);

impl std::fmt::Display for Logged<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.worker() {
            Some(w) => write!(f, "{}: {}", w.id_text, self.0),
            None => write!(f, "{}", self.0),
        }
    }
}

impl<S> Respond<S> {
    pub fn new(inner: S, ctx: &Ctx, errors: &Arc<Errors>) -> Respond<S> {
        Respond {
            inner,
            ctx: ctx.clone(),
            errors: errors.clone(),
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

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let started = Instant::now();
        let ctx = &self.ctx;
        let (labels, slot) = {
            let snap = ctx.table.snapshot.load();
            (ctx.metrics).labels(ctx.grpc(), req.uri().path(), &snap)
        };
        if let Some(slot) = &slot {
            req.extensions_mut().insert(slot.clone());
        }
        let access = self.errors.access_log.then(|| {
            Box::new(Access {
                method: req.method().clone(),
                path: req.uri().path().to_string(),
                request_id: req.headers().get(super::identity::REQUEST_ID).cloned(),
                status: 0,
                worker: None,
                attempts: 0,
                bytes: 0,
                ttfb: None,
            })
        });
        let key = ctx.conn().client.filter(|_| counted(ctx, req.uri().path()));
        let (inner, client) = match key {
            None => (Some(self.inner.call(req)), None),
            Some(key) if ctx.clients.take(key) => {
                (Some(self.inner.call(req)), Some(ClientStream::new(ctx)))
            }
            // Refused before anything below runs (no body read for a request turned away).
            Some(_) => (None, None),
        };
        Responding {
            started,
            inner,
            ctx: self.ctx.clone(),
            errors: self.errors.clone(),
            labels,
            slot,
            access,
            client,
        }
    }
}

/// The answer of the layers below, turned into the client's response. A future of its own
/// rather than a boxed `async` block: this is one allocation less on every request.
pub struct Responding<F> {
    /// `None`: refused for its address's `server.max_streams_per_client`.
    inner: Option<F>,
    started: Instant,
    ctx: Ctx,
    errors: Arc<Errors>,
    labels: RequestLabels,
    /// Where `select` writes the request's model, in a fleet that routes by model.
    slot: Option<ModelSlot>,
    access: Option<Box<Access>>,
    /// The request's place among its address's streams, moved into the answer's body.
    client: Option<ClientStream>,
}

impl<F: Future<Output = Answer> + Unpin> Future for Responding<F> {
    type Output = Result<Response<ProxyBody>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let answer = match &mut this.inner {
            Some(inner) => ready!(Pin::new(inner).poll(cx)),
            None => Err(ProxyError::ClientStreams(this.ctx.clients.limit)),
        };
        let (ctx, mut labels) = (&this.ctx, this.labels);
        if let Some(slot) = &this.slot {
            labels.model = slot.get();
        }
        let (worker, attempts) = match &answer {
            Ok(resp) => (
                (resp.body().target.as_ref()).map(|t| t.worker.id_text.clone()),
                resp.body().holds.attempts,
            ),
            Err(e) => (e.worker().map(|w| w.id_text.clone()), e.attempts()),
        };
        // The status counted and logged: an error's own (a gRPC error answer is HTTP 200 with
        // its code in a header, and its log line said 200 for a refusal).
        let (mut resp, status) = match answer {
            Ok(resp) => {
                let status = super::grpc::answered(&resp, ctx.grpc()).as_u16();
                match &resp.body().target {
                    Some(t) => ctx.metrics.response(&t.worker, labels, status),
                    None => ctx.metrics.local_response(labels, status),
                }
                (resp, status)
            }
            Err(e) => {
                count(ctx, &e, labels);
                let mut resp = render(ctx, &this.errors, &e);
                // A failed decode leg's line names its prefill leg too.
                if let ProxyError::Decode(d) = e.root() {
                    resp.body_mut().holds.prefill = Some(Box::new(d.prefill.clone()));
                }
                (resp, e.status().as_u16())
            }
        };
        resp.body_mut().holds.attempts = attempts;
        let mut done = Done::new(this.started, ctx, labels.model);
        done.prefill = resp.body_mut().holds.prefill.take();
        if let Some(mut a) = this.access.take() {
            a.status = status;
            a.worker = worker;
            a.attempts = attempts;
            done.access = Some(a);
        }
        let holds = &mut resp.body_mut().holds;
        holds.done = Some(done);
        holds.client = this.client.take();
        Poll::Ready(Ok(resp))
    }
}

/// Whether a request counts among its address's streams: one an engine serves. rankgate's own
/// answers (the model list, gRPC health, `GetLoads`, `FlushCache`, and `Abort` above all: it
/// frees a place) hold nothing of the fleet, and a client at its cap must still get them.
fn counted(ctx: &Ctx, path: &str) -> bool {
    match ctx.grpc() {
        true => super::grpc::proxied(path),
        false => !super::route::answered_here(path),
    }
}

/// The client's answer to `err`, counted: for `cors`' refusals, made outside this layer (and
/// before anything labelled the request).
pub(super) fn error_response(ctx: &Ctx, errors: &Errors, err: &ProxyError) -> Response<ProxyBody> {
    count(ctx, err, ctx.metrics.unlabelled());
    render(ctx, errors, err)
}

/// Counts a request answered with `err`: on its worker, if it reached one.
fn count(ctx: &Ctx, err: &ProxyError, labels: RequestLabels) {
    let status = err.status().as_u16();
    match err.worker() {
        Some(w) => ctx.metrics.response(w, labels, status),
        None => ctx.metrics.local_response(labels, status),
    }
}

/// The client's answer to `err`.
fn render(ctx: &Ctx, errors: &Errors, err: &ProxyError) -> Response<ProxyBody> {
    let status = err.status();
    if status.is_server_error() {
        if let Some(held) = errors.storm.allow() {
            tracing::warn!(status = status.as_u16(), error = %Logged(err), similar_since_last = held, "request failed");
        }
    } else {
        tracing::debug!(status = status.as_u16(), error = %Logged(err), "request refused");
    }
    let message = errors.exposure.error(err);
    let worker = err.worker().and_then(|w| errors.exposure.worker(w));
    if ctx.grpc() {
        let mut resp = super::grpc::status_response(err.grpc_code(), &message);
        if let ProxyError::Grpc(super::error::GrpcError { http: Some(s), .. }) = err.root() {
            *resp.status_mut() = *s;
        }
        if let Some(w) = worker {
            resp.headers_mut().insert(WORKER_HEADER, w.clone());
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
            .insert(header::RETRY_AFTER, errors.retry_after.clone());
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
    if let Some(w) = worker {
        resp.headers_mut().insert(WORKER_HEADER, w.clone());
    }
    resp
}
