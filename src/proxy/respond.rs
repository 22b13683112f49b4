//! The outermost layer: every error becomes an OpenAI-shaped response, every response is counted,
//! and each request's latency is recorded when its body ends.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{header, HeaderValue, Request, Response, StatusCode};
use tokio::time::Instant;

use super::body::Done;
use super::{BoxFuture, ProxyBody, ProxyError, Shared, WORKER_HEADER};
use crate::http::Throttle;

#[derive(Clone)]
pub struct Respond<S> {
    inner: S,
    parts: Arc<Parts>,
}

impl<S> Respond<S> {
    pub fn new(inner: S, shared: &Arc<Shared>) -> Respond<S> {
        Respond {
            inner,
            parts: Arc::new(Parts {
                retry_after: HeaderValue::from(shared.cfg.routing.retry_after_secs),
                shared: shared.clone(),
                storm: Throttle::new(Duration::from_secs(5)),
            }),
        }
    }
}

impl<S, B> tower::Service<Request<B>> for Respond<S>
where
    S: tower::Service<Request<B>, Response = Response<ProxyBody>, Error = ProxyError>,
    S::Future: Send + 'static,
{
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<ProxyBody>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Every layer below is always ready: admission is decided per request, as a 429.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let started = Instant::now();
        let fut = self.inner.call(req);
        let this = self.parts.clone();
        Box::pin(async move {
            Ok(match fut.await {
                Ok(mut resp) => {
                    let metrics = &this.shared.metrics;
                    if let Some(t) = resp.body().target {
                        metrics.response(t.worker, resp.status().as_u16());
                    }
                    resp.body_mut().holds.done = Some(Done {
                        started,
                        metrics: metrics.clone(),
                    });
                    resp
                }
                Err(e) => this.error_response(&e),
            })
        })
    }
}

/// What the response future needs of the layer (not its inner service), in one `Arc` since the
/// layer is cloned per request.
struct Parts {
    shared: Arc<Shared>,
    /// One log line per few seconds for server-side errors, however many requests hit them.
    storm: Throttle,
    retry_after: HeaderValue,
}

impl Parts {
    fn error_response(&self, err: &ProxyError) -> Response<ProxyBody> {
        let status = err.status();
        let metrics = &self.shared.metrics;
        let message = match err.worker() {
            Some(w) => {
                metrics.response(w, status.as_u16());
                format!("{}: {err}", self.shared.table.fleet.workers[w].id_text)
            }
            None => {
                metrics.own_response(status.as_u16());
                err.to_string()
            }
        };
        if status.is_server_error() {
            if let Some(held) = self.storm.allow() {
                tracing::warn!(status = status.as_u16(), error = %message, similar_since_last = held, "request failed");
            }
        } else {
            tracing::debug!(status = status.as_u16(), error = %message, "request refused");
        }
        let mut resp: Response<ProxyBody> = crate::http::openai_error(status, err.kind(), &message);
        if matches!(
            status,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
        ) {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, self.retry_after.clone());
        }
        if let Some(w) = err.worker() {
            resp.headers_mut()
                .insert(WORKER_HEADER, self.shared.worker_header(w));
        }
        resp
    }
}
