//! Admission: at most `server.max_in_flight` requests at once through the front door; past it a
//! request gets 429 at once rather than a queue that only grows while the fleet is saturated.

use std::sync::atomic::Ordering::Relaxed;

use http::Request;

use super::{Below, Ctx, ProxyError, Step};

#[derive(Clone)]
pub struct Admit<S> {
    inner: S,
    limit: Option<usize>,
    ctx: Ctx,
}

/// One admitted request, counted (in [`super::Shared`]) until its response body ends.
#[derive(Debug)]
pub struct Admitted(Ctx);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.admitted.fetch_sub(1, Relaxed);
    }
}

impl<S> Admit<S> {
    pub fn new(inner: S, ctx: &Ctx) -> Admit<S> {
        Admit {
            inner,
            limit: ctx.cfg.server.max_in_flight,
            ctx: ctx.clone(),
        }
    }
}

impl<S, B> tower::Service<Request<B>> for Admit<S>
where
    S: Below<B>,
{
    layer_types!(Step<S::Future>);

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let Some(limit) = self.limit else {
            return Step::Below(self.inner.call(req));
        };
        let count = &self.ctx.admitted;
        if count.fetch_add(1, Relaxed) >= limit {
            count.fetch_sub(1, Relaxed);
            return Step::ready(Err(ProxyError::Overloaded(limit)));
        }
        let admitted = Admitted(self.ctx.clone());
        let fut = self.inner.call(req);
        Step::Own(Box::pin(async move {
            let mut resp = fut.await?;
            resp.body_mut().holds.admitted = Some(admitted);
            Ok(resp)
        }))
    }
}
