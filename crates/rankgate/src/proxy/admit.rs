//! Admission: at most `server.max_in_flight` requests at once through the front door; past it a
//! request gets 429 at once rather than a queue that only grows while the fleet is saturated.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use http::Request;

use super::error::ProxyError;
pub use super::guards::Admission;
use super::guards::Admitted;
use super::layer::{Below, Step};

#[derive(Clone)]
pub struct Admit<S> {
    inner: S,
    /// The count under `server.max_in_flight`, one for all connections; `None`: no limit.
    admission: Option<Arc<Admission>>,
}

impl<S> Admit<S> {
    pub fn new(inner: S, admission: &Option<Arc<Admission>>) -> Admit<S> {
        Admit {
            inner,
            admission: admission.clone(),
        }
    }
}

impl<S, B> tower::Service<Request<B>> for Admit<S>
where
    S: Below<B>,
{
    layer_types!(Step<S::Future>);

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let Some(admission) = &self.admission else {
            return Step::Below(self.inner.call(req));
        };
        let (count, limit) = (&admission.count, admission.limit);
        if count.fetch_add(1, Relaxed) >= limit {
            count.fetch_sub(1, Relaxed);
            return Step::ready(Err(ProxyError::Overloaded(limit)));
        }
        let admitted = Admitted(admission.clone());
        let fut = self.inner.call(req);
        Step::Own(Box::pin(async move {
            let mut resp = fut.await?;
            resp.body_mut().holds.admitted = Some(admitted);
            Ok(resp)
        }))
    }
}
