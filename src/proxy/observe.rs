//! Outlier accounting: each attempt's outcome is recorded on its rank (see [`crate::outlier`]).
//! 5xx answers and response timeouts count against the rank, transport failures against every
//! rank of the engine; 4xx answers, the client's own errors and clients that leave never count.
//! A response that starts well is judged when its body ends: a clean end is a success, a stream
//! that breaks or goes quiet a failure.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::Request;
use http_body::Body as _;

use super::{Answer, Below, Ctx, Picked, ProxyError, Shared, Target};
use crate::metrics::Attempt;
use crate::outlier::{Cause, Policy};

#[derive(Clone)]
pub struct Observe<S> {
    inner: S,
    ctx: Ctx,
}

impl<S> Observe<S> {
    pub fn new(inner: S, ctx: &Ctx) -> Observe<S> {
        Observe {
            inner,
            ctx: ctx.clone(),
        }
    }
}

fn policy(shared: &Shared) -> Policy {
    Policy {
        after: shared.cfg.routing.eject_after,
        base: shared.cfg.routing.eject_for,
    }
}

/// Records a failure of `cause` on worker `w` (on all of its engine's ranks for the transport).
fn failure(shared: &Shared, target: &Target, cause: Cause) {
    let ranks = match cause {
        Cause::Transport => &target.engine.members[..],
        Cause::Status(_) | Cause::Timeout | Cause::Mixed => std::slice::from_ref(&target.worker),
    };
    for w in ranks {
        if let Some(e) = w.live.outlier.failure(cause, policy(shared)) {
            shared.metrics.ejected(w);
            tracing::warn!(worker = %w.id_text, reason = %e, "rank ejected");
        }
    }
}

/// The verdict on a response whose headers were fine: success once its body ends cleanly, a
/// failure if it breaks after its headers went out (against its engine, or its rank when the
/// engine just went quiet). Judging at the headers would let every new stream of a rank that
/// stalls mid-way wipe the failure the previous stall counted, so it would never be ejected (and
/// a trial would re-admit it on headers alone). A body dropped unfinished (the client left) is no
/// verdict: a trial passes to the next request.
#[derive(Debug)]
pub struct BreakWatch {
    ctx: Ctx,
    target: Target,
    judged: bool,
}

impl BreakWatch {
    pub fn fire(mut self, idle: bool) {
        self.judged = true;
        let cause = if idle {
            Cause::Timeout
        } else {
            Cause::Transport
        };
        failure(&self.ctx, &self.target, cause);
    }

    /// The body ended cleanly.
    pub fn ended(mut self) {
        self.judged = true;
        success(&self.ctx, &self.target);
    }

    /// The stream ended with a failure status after its first byte (a gRPC call's trailers
    /// saying UNAVAILABLE): a failure of the rank, not of the whole engine's transport.
    pub fn failed(mut self, status: u16) {
        self.judged = true;
        failure(&self.ctx, &self.target, Cause::Status(status));
    }
}

impl Drop for BreakWatch {
    fn drop(&mut self) {
        if !self.judged && self.target.trial {
            self.target.worker.live.outlier.abandon_trial();
        }
    }
}

fn success(_shared: &Shared, target: &Target) {
    if target.worker.live.outlier.success() {
        tracing::info!(worker = %target.worker.id_text, "rank re-admitted after a successful trial");
    }
}

impl<S> tower::Service<Request<Picked>> for Observe<S>
where
    S: Below<Picked>,
{
    layer_types!(Observing<S::Future>);

    fn call(&mut self, req: Request<Picked>) -> Self::Future {
        let target = req.body().target.clone();
        Observing {
            inner: self.inner.call(req),
            ctx: self.ctx.clone(),
            open: target.trial,
            target,
        }
    }
}

/// An attempt's answer, recorded on its rank when it comes. A future of its own rather than a
/// boxed `async` block: one allocation less on every request.
pub struct Observing<F> {
    inner: F,
    ctx: Ctx,
    target: Target,
    /// A trial with no verdict yet: one dropped before its answer (the client left) hands the
    /// trial to the next request.
    open: bool,
}

impl<F> Drop for Observing<F> {
    fn drop(&mut self) {
        if self.open {
            self.target.worker.live.outlier.abandon_trial();
        }
    }
}

impl<F: Future<Output = Answer> + Unpin> Future for Observing<F> {
    type Output = Answer;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Answer> {
        let this = self.get_mut();
        let (ctx, target) = (&this.ctx, &this.target);
        // Errors below are located here, on the attempt's worker.
        let mut result =
            ready!(Pin::new(&mut this.inner).poll(cx)).map_err(|e| e.at(&target.worker));
        let attempt = match &result {
            Ok(resp) if super::grpc::answered(resp, ctx.grpc()).is_server_error() => {
                Attempt::ServerError
            }
            Ok(_) => Attempt::Answered,
            Err(e) => match e.root() {
                ProxyError::Upstream { .. } => Attempt::Transport,
                ProxyError::Timeout(_) => Attempt::Timeout,
                ProxyError::EngineBusy { .. } => Attempt::Busy,
                _ => Attempt::Other,
            },
        };
        ctx.metrics.attempt(&target.worker, attempt);
        let judged = match &mut result {
            Ok(resp) if super::grpc::answered(resp, ctx.grpc()).is_server_error() => {
                let status = super::grpc::answered(resp, ctx.grpc());
                failure(ctx, target, Cause::Status(status.as_u16()));
                true
            }
            Ok(resp) if !resp.status().is_client_error() => {
                if resp.body().is_end_stream() {
                    // Nothing left to come: hyper may never poll an empty body.
                    success(ctx, target);
                } else {
                    resp.body_mut().holds.on_break = Some(BreakWatch {
                        ctx: ctx.clone(),
                        target: target.clone(),
                        judged: false,
                    });
                }
                true
            }
            Ok(_) => false,
            Err(e) => match e.root() {
                ProxyError::Upstream { .. } => {
                    failure(ctx, target, Cause::Transport);
                    true
                }
                ProxyError::Timeout(_) => {
                    failure(ctx, target, Cause::Timeout);
                    true
                }
                _ => false,
            },
        };
        if judged {
            this.open = false;
        }
        Poll::Ready(result)
    }
}
