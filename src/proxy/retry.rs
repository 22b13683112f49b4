//! Failover before the first byte: a request whose upstream failed before anything reached the
//! client (the transport failed, or the engine answered 502/503/504) is sent again to a
//! different rank, and to a different engine when the transport failed, up to
//! `routing.max_attempts`. Never after a byte went to the client (this layer only ever sees
//! response heads), never on 4xx or the client's own errors, never for a client that left (its
//! future is dropped), never for a body too large to keep.
//!
//! Retries draw on a budget ([`super::budget`]: a share of the requests of the last 10 s plus a
//! floor of 2 per second), so when the whole fleet fails, retries cannot multiply the outage.

use std::sync::Arc;

use http::{Request, Response};

use super::budget::RetryBudget;
use super::{Below, ProxyBody, ProxyError, RequestBody, Shared};
use crate::policy::Avoid;

#[derive(Clone)]
pub struct Retry<S> {
    inner: S,
    state: Arc<(Arc<Shared>, RetryBudget)>,
}

impl<S> Retry<S> {
    pub fn new(inner: S, shared: &Arc<Shared>) -> Retry<S> {
        let budget = RetryBudget::new(shared.cfg.routing.retry_budget);
        Retry {
            inner,
            state: Arc::new((shared.clone(), budget)),
        }
    }
}

/// Why an attempt may be worth another: the worker it failed on, and whether the transport
/// failed (then the whole engine is avoided).
fn failed(result: &Result<Response<ProxyBody>, ProxyError>) -> Option<(usize, bool)> {
    match result {
        Ok(resp) if matches!(resp.status().as_u16(), 502..=504) => {
            resp.body().target.map(|t| (t.worker, false))
        }
        Err(e) if e.retryable() => e.worker().map(|w| (w, true)),
        _ => None,
    }
}

impl<S> tower::Service<Request<RequestBody>> for Retry<S>
where
    S: Below<RequestBody> + Clone + Send + 'static,
{
    layer_types!();

    fn call(&mut self, req: Request<RequestBody>) -> Self::Future {
        let (shared, budget) = &*self.state;
        budget.deposit();
        let max = shared.cfg.routing.max_attempts;
        // Only a body kept whole can be sent twice; the head is copied only then.
        let again = (max > 1)
            .then(|| req.body().replay())
            .flatten()
            .map(|body| (head(&req), body));
        let Some((head, body)) = again else {
            return self.inner.call(req);
        };
        let mut inner = self.inner.clone();
        let state = self.state.clone();
        Box::pin(async move {
            let (shared, budget) = &*state;
            let mut result = inner.call(req).await;
            let mut avoid = Avoid::default();
            for _ in 1..max {
                let Some((worker, transport)) = failed(&result) else {
                    break;
                };
                if !budget.withdraw() {
                    shared.metrics.retry_refused();
                    break;
                }
                if transport {
                    avoid.engine(shared.table.fleet.workers[worker].engine);
                } else {
                    avoid.worker(worker);
                }
                let mut next = rebuild(
                    &head,
                    body.replay()
                        .unwrap_or(RequestBody::Full(Default::default())),
                );
                next.extensions_mut().insert(avoid.clone());
                let again = inner.call(next).await;
                // No other rank to go to: the failure the client gets is the real one.
                if matches!(
                    again.as_ref().map_err(ProxyError::root),
                    Err(ProxyError::NoRank(_))
                ) {
                    break;
                }
                shared.metrics.retried();
                result = again;
            }
            result
        })
    }
}

/// The request head, for building later attempts.
struct Head {
    method: http::Method,
    uri: http::Uri,
    version: http::Version,
    headers: http::HeaderMap,
}

fn head(req: &Request<RequestBody>) -> Head {
    Head {
        method: req.method().clone(),
        uri: req.uri().clone(),
        version: req.version(),
        headers: req.headers().clone(),
    }
}

fn rebuild(h: &Head, body: RequestBody) -> Request<RequestBody> {
    let mut req = Request::new(body);
    *req.method_mut() = h.method.clone();
    *req.uri_mut() = h.uri.clone();
    *req.version_mut() = h.version;
    *req.headers_mut() = h.headers.clone();
    req
}
