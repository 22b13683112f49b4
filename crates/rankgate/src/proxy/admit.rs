//! Admission: at most `server.max_in_flight` requests at once through the front door, and at
//! most `server.max_streams_per_client` from one client address; past either a request gets
//! 429 at once rather than a queue that only grows while the fleet is saturated (or while one
//! address holds it). Peers in `server.trusted_proxies` carry many clients' requests and are
//! held only to the first.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Request;

use super::error::ProxyError;
pub use super::guards::Admission;
use super::guards::{Admitted, ClientStream};
use super::identity::Forwarding;
use super::layer::{Answer, Below};
use super::shared::Ctx;

#[derive(Clone)]
pub struct Admit<S> {
    inner: S,
    ctx: Ctx,
    /// The count under `server.max_in_flight`, one for all connections; `None`: no limit.
    admission: Option<Arc<Admission>>,
    /// The connection's peer is a trusted proxy: no per-client limit.
    gateway: bool,
}

impl<S> Admit<S> {
    pub fn new(
        inner: S,
        ctx: &Ctx,
        admission: &Option<Arc<Admission>>,
        forwarding: &Forwarding,
    ) -> Admit<S> {
        let peer = ctx.conn().peer.ip();
        Admit {
            inner,
            ctx: ctx.clone(),
            admission: admission.clone(),
            gateway: forwarding.trusted.iter().any(|c| c.contains(peer)),
        }
    }
}

impl<S, B> tower::Service<Request<B>> for Admit<S>
where
    S: Below<B>,
{
    layer_types!(Admitting<S::Future>);

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let client = match self.gateway {
            true => None,
            false => {
                let (clients, key) = (&self.ctx.clients, self.ctx.conn().client);
                if !clients.take(key) {
                    return Admitting::refused(ProxyError::ClientStreams(clients.limit));
                }
                Some(ClientStream::new(&self.ctx))
            }
        };
        let admitted = match &self.admission {
            None => None,
            Some(admission) => {
                let (count, limit) = (&admission.count, admission.limit);
                if count.fetch_add(1, Relaxed) >= limit {
                    count.fetch_sub(1, Relaxed);
                    return Admitting::refused(ProxyError::Overloaded(limit));
                }
                Some(Admitted(admission.clone()))
            }
        };
        Admitting {
            fut: Some(self.inner.call(req)),
            refused: None,
            admitted,
            client,
        }
    }
}

/// The layer below's answer, which takes the request's admission with it into the response
/// body (so the counts go down when the answer ends). Not boxed: a request costs no allocation
/// here.
pub struct Admitting<F> {
    fut: Option<F>,
    refused: Option<ProxyError>,
    admitted: Option<Admitted>,
    client: Option<ClientStream>,
}

impl<F> Admitting<F> {
    fn refused(e: ProxyError) -> Admitting<F> {
        Admitting {
            fut: None,
            refused: Some(e),
            admitted: None,
            client: None,
        }
    }
}

impl<F: Future<Output = Answer> + Unpin> Future for Admitting<F> {
    type Output = Answer;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Answer> {
        let this = self.get_mut();
        let Some(fut) = &mut this.fut else {
            let e = (this.refused.take()).unwrap_or(ProxyError::Internal("polled again".into()));
            return Poll::Ready(Err(e));
        };
        let mut resp = std::task::ready!(Pin::new(fut).poll(cx))?;
        let holds = &mut resp.body_mut().holds;
        holds.admitted = this.admitted.take();
        holds.client = this.client.take();
        Poll::Ready(Ok(resp))
    }
}
