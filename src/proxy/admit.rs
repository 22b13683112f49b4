//! Admission: at most `server.max_in_flight` requests at once through the front door; past it a
//! request gets 429 at once rather than a queue that only grows while the fleet is saturated.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use http::Request;

use super::{ready, Below, ProxyError};

#[derive(Clone)]
pub struct Admit<S> {
    inner: S,
    limit: Option<usize>,
    count: Arc<AtomicUsize>,
}

/// One admitted request, counted until its response body ends.
#[derive(Debug)]
pub struct Admitted(Arc<AtomicUsize>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

impl<S> Admit<S> {
    pub fn new(inner: S, limit: Option<usize>) -> Admit<S> {
        Admit {
            inner,
            limit,
            count: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl<S, B> tower::Service<Request<B>> for Admit<S>
where
    S: Below<B>,
{
    layer_types!();

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let Some(limit) = self.limit else {
            return self.inner.call(req);
        };
        if self.count.fetch_add(1, Relaxed) >= limit {
            self.count.fetch_sub(1, Relaxed);
            return ready(Err(ProxyError::Overloaded(limit)));
        }
        let admitted = Admitted(self.count.clone());
        let fut = self.inner.call(req);
        Box::pin(async move {
            let mut resp = fut.await?;
            resp.body_mut().holds.admitted = Some(admitted);
            Ok(resp)
        })
    }
}
