//! Flow control (`[flow]`): when every rank a request may use is saturated, the request waits
//! in rankgate, and leaves by priority (its objective), fairly between tenants (by the tokens
//! they cost), first come first served within a tenant; its rank is picked when it leaves.
//! Past its wait, or past the queue's caps, it gets 503 with `Retry-After` and an error naming
//! why; a client that goes away leaves the queue at once; at shutdown what still waits when
//! the drain grace ends is answered 503. Off, the layer passes every request straight on.
//!
//! The layer sits below `admit` and above `disagg`, so a disaggregated request waits once, for
//! room on both of its sides. One file per concern: `queue` (the order, as data), `control`
//! (the router's queue, its wakes and its pump), `who` (tenant and objective), `charge` (the
//! tokens an answer costs its tenant), `stats` and `refusal` (what is counted and told).

pub(crate) mod charge;
mod control;
mod queue;
pub(crate) mod refusal;
mod stats;
mod view;
pub(crate) mod who;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Request;
use tokio::time::Instant;

use super::disagg::Split;
use super::error::ProxyError;
use super::layer::{content_length, ready, Answer, Below, BoxFuture};
use super::shared::Ctx;
use crate::policy::Avoid;
use crate::prompt::PromptTokens;
use crate::upstream::RequestBody;

pub use charge::Charge;
pub use control::Flows;
pub use refusal::{Refusal, Refused};
pub use view::{collector, page};
pub use who::KeyBinding;

use charge::Pending;
use control::{Arrival, Ask, Go};
use queue::Tenant;

/// Bytes of a prompt counted as one token when the prompt was not tokenized.
const BYTES_PER_TOKEN: u64 = 4;

#[derive(Clone)]
pub struct Flow<S> {
    inner: S,
    ctx: Ctx,
    flows: Option<Arc<Flows>>,
}

impl<S> Flow<S> {
    pub fn new(inner: S, ctx: &Ctx, flows: &Option<Arc<Flows>>) -> Flow<S> {
        Flow {
            inner,
            ctx: ctx.clone(),
            flows: flows.clone(),
        }
    }
}

impl<S> tower::Service<Request<RequestBody>> for Flow<S>
where
    S: Below<RequestBody> + Clone + Send + 'static,
{
    layer_types!(Flowing<S::Future>);

    fn call(&mut self, req: Request<RequestBody>) -> Self::Future {
        let Some(flows) = &self.flows else {
            return Flowing::Below(self.inner.call(req));
        };
        let cfg = &flows.cfg;
        let (headers, ext) = (req.headers(), req.extensions());
        let key = ext.get::<Arc<KeyBinding>>().map(|k| &**k);
        let who = who::who(cfg, headers, key, &self.ctx.conn().peer_ip);
        let objective = &cfg.objectives[who.objective];
        let bytes = match req.body() {
            RequestBody::Full(b) => b.len() as u64,
            RequestBody::Stream(_) => content_length(headers).unwrap_or(0),
        };
        let ask = Ask {
            objective: who.objective,
            bytes,
            cost: match ext.get::<PromptTokens>() {
                Some(t) => t.0.len() as u64,
                None => bytes.div_ceil(BYTES_PER_TOKEN),
            },
            weight: objective.weight,
        };
        // The prompt, read only for a request that waits while prefix affinity is on.
        let prompt = || match req.body() {
            RequestBody::Full(b) => Some(crate::prompt::Prompt {
                chunks: crate::prefix::prompt_chunks(b),
                tokens: ext.get::<PromptTokens>().map(|t| t.0.clone()),
            }),
            RequestBody::Stream(_) => None,
        };
        let arrival = flows.arrive(
            who.tenant,
            ask,
            ext.get::<Avoid>(),
            ext.get::<Split>(),
            prompt,
        );
        let objective = who.objective;
        let max_wait = match arrival {
            Arrival::Queued(..) => who::max_wait(cfg, headers, objective),
            _ => std::time::Duration::ZERO,
        };
        let req = match cfg.objectives[objective].engine_priority {
            Some(p) => with_engine_priority(req, p),
            None => req,
        };
        let band = flows.band_of[objective];
        let tenant = match arrival {
            // The usual case, with room: straight on, no future of this layer's own to box.
            Arrival::Now(tenant, pending) => {
                let mut charge = Charge::start(tenant, band, ask.weight, &flows.wake);
                charge.pending = Some(pending);
                return Flowing::Sent(self.inner.call(req), Some(charge));
            }
            Arrival::Refused(tenant, why) => {
                return Flowing::Own(ready(Err(refuse(flows, &tenant, objective, why, None))))
            }
            Arrival::Queued(tenant, seq, rx) => (tenant, seq, rx),
        };
        let (flows, mut inner) = (flows.clone(), self.inner.clone());
        Flowing::Own(Box::pin(async move {
            let (tenant, seq, rx) = tenant;
            let pending = match wait(&flows, &tenant, objective, seq, rx, max_wait).await {
                Ok(pending) => pending,
                Err((why, waited)) => {
                    return Err(refuse(&flows, &tenant, objective, why, Some(waited)))
                }
            };
            let mut charge = Charge::start(tenant, band, ask.weight, &flows.wake);
            charge.pending = Some(pending);
            Flowing::Sent(inner.call(req), Some(charge)).await
        }))
    }
}

/// The flow layer's future: passed through (off), sent on (room now; or after waiting, inside
/// the boxed wait), or answered.
pub enum Flowing<F> {
    Below(F),
    /// The request below, and its charge: moved into the answer's body to charge its output
    /// and end with it. The charge holds the request's `Pending` until the first poll has run
    /// the pick (a whole request's pick is in `call`; a disaggregated one's prefill pick after
    /// its body).
    Sent(F, Option<Box<Charge>>),
    Own(BoxFuture<Answer>),
}

impl<F: Future<Output = Answer> + Unpin> Future for Flowing<F> {
    type Output = Answer;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Answer> {
        match self.get_mut() {
            Flowing::Below(f) => Pin::new(f).poll(cx),
            Flowing::Own(f) => f.as_mut().poll(cx),
            Flowing::Sent(inner, charge) => {
                let answer = Pin::new(inner).poll(cx);
                if let Some(c) = charge {
                    c.pending = None;
                }
                let Poll::Ready(answer) = answer else {
                    return Poll::Pending;
                };
                let mut resp = answer?;
                resp.body_mut().holds.flow = charge.take();
                Poll::Ready(Ok(resp))
            }
        }
    }
}

/// Waits for the queue's word, at most `max_wait` from arrival; a dropped wait (the client
/// left) takes the request out of the queue.
async fn wait(
    flows: &Arc<Flows>,
    tenant: &Arc<Tenant>,
    objective: usize,
    seq: u64,
    mut rx: tokio::sync::oneshot::Receiver<Go>,
    max_wait: std::time::Duration,
) -> Result<Pending, (Refusal, std::time::Duration)> {
    let since = Instant::now();
    let mut leave = Leave {
        flows,
        tenant,
        objective,
        seq,
        since,
        armed: true,
    };
    let word = tokio::select! {
        word = &mut rx => word,
        _ = tokio::time::sleep(max_wait) => {
            if flows.leave(objective, tenant, seq) {
                leave.armed = false;
                flows.stats[objective].refused(Refusal::Deadline, Some(since.elapsed()));
                return Err((Refusal::Deadline, since.elapsed()));
            }
            // It was sent on (or refused) as its time ran out: its word is in the channel.
            rx.await
        }
    };
    leave.armed = false;
    match word {
        Ok(Go::Send(pending)) => Ok(pending),
        Ok(Go::Refuse(why)) => {
            flows.stats[objective].refused(why, Some(since.elapsed()));
            Err((why, since.elapsed()))
        }
        // The queue was dropped with the router.
        Err(_) => Err((Refusal::ShuttingDown, since.elapsed())),
    }
}

/// A waiting request's place, given up if its wait is dropped before the queue answered.
struct Leave<'a> {
    flows: &'a Arc<Flows>,
    tenant: &'a Arc<Tenant>,
    objective: usize,
    seq: u64,
    since: Instant,
    armed: bool,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        if self.armed && self.flows.leave(self.objective, self.tenant, self.seq) {
            let waited = Some(self.since.elapsed());
            self.flows.stats[self.objective].refused(Refusal::ClientGone, waited);
            self.tenant
                .rejected
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The error for a refused request, counted.
fn refuse(
    flows: &Flows,
    tenant: &Tenant,
    objective: usize,
    why: Refusal,
    waited: Option<std::time::Duration>,
) -> ProxyError {
    if waited.is_none() {
        flows.stats[objective].refused(why, None);
    }
    tenant
        .rejected
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    ProxyError::Flow(Box::new(Refused {
        why,
        tenant: tenant.name.to_string(),
        objective: flows.cfg.objectives[objective].name.clone(),
        waited: waited.unwrap_or_default(),
    }))
}

/// The objective's priority written into a JSON body (`priority`: vLLM's
/// `--scheduling-policy priority` orders its queue by it). A body not kept whole, or not a JSON
/// object, goes as it is.
fn with_engine_priority(req: Request<RequestBody>, p: i64) -> Request<RequestBody> {
    let (mut parts, body) = req.into_parts();
    let body = match body {
        RequestBody::Full(whole) => match super::pin::set_member(&whole, "priority", p) {
            Ok(written) => {
                parts
                    .headers
                    .insert(http::header::CONTENT_LENGTH, written.len().into());
                RequestBody::Full(written)
            }
            Err(_) => RequestBody::Full(whole),
        },
        streamed => streamed,
    };
    Request::from_parts(parts, body)
}
