//! Outlier accounting: each attempt's outcome is recorded on its rank (see [`crate::outlier`]).
//! 5xx answers and response timeouts count against the rank, transport failures against every
//! rank of the engine; 4xx answers, the client's own errors and clients that leave never count,
//! nor a decode server's 500 (a KV transfer that failed may be its prefill server's doing).
//! A response that starts well is judged when its body ends: a clean end is a success, a stream
//! that breaks or goes quiet a failure.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::Request;
use http_body::Body as _;

use super::error::ProxyError;
use super::guards::{failure, success, BreakWatch};
use super::layer::{Answer, Below};
use super::shared::Ctx;
use super::target::{Picked, Target};
use crate::metrics::Attempt;
use crate::outlier::{Cause, Policy};
use crate::worker::Role;

#[derive(Clone)]
pub struct Observe<S> {
    inner: S,
    ctx: Ctx,
    /// `routing.eject_after` and `routing.eject_for`.
    policy: Policy,
}

impl<S> Observe<S> {
    pub fn new(inner: S, ctx: &Ctx, policy: Policy) -> Observe<S> {
        Observe {
            inner,
            ctx: ctx.clone(),
            policy,
        }
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
            policy: self.policy,
            trial: Trial {
                open: target.trial,
                target,
            },
        }
    }
}

/// An attempt's answer, recorded on its rank when it comes. A future of its own rather than a
/// boxed `async` block: one allocation less on every request.
pub struct Observing<F> {
    /// Dropped first (fields drop in order): a request dropped after waiting long enough to be
    /// hung fails its rank there (`send`), which ends a trial with a new ejection before
    /// [`Trial`] would hand it on.
    inner: F,
    ctx: Ctx,
    policy: Policy,
    trial: Trial,
}

/// The attempt's target, and whether it is a trial with no verdict yet: one dropped before its
/// answer (the client left) hands the trial to the next request.
struct Trial {
    target: Target,
    open: bool,
}

impl Drop for Trial {
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
        let (ctx, policy, target) = (&this.ctx, this.policy, &this.trial.target);
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
                // A decode server answers 500 when it could not pull its prompt's KV, which is
                // its prefill server's failure as often as its own (one dead prefill server
                // would otherwise eject every decode rank pulling from it): no verdict. The
                // request is run again from a new prefill (`disagg`).
                if status == 500 && target.worker.role == Role::Decode {
                    false
                } else {
                    failure(&ctx.metrics, policy, target, Cause::Status(status.as_u16()));
                    true
                }
            }
            Ok(resp) if !resp.status().is_client_error() => {
                if resp.body().is_end_stream() {
                    // Nothing left to come: hyper may never poll an empty body.
                    success(target);
                } else {
                    let watch = BreakWatch::new(ctx, policy, target.clone());
                    resp.body_mut().holds.on_break = Some(watch);
                }
                true
            }
            Ok(_) => false,
            Err(e) => match e.root() {
                ProxyError::Upstream { .. } => {
                    failure(&ctx.metrics, policy, target, Cause::Transport);
                    true
                }
                ProxyError::Timeout(_) => {
                    failure(&ctx.metrics, policy, target, Cause::Timeout);
                    true
                }
                _ => false,
            },
        };
        if judged {
            this.trial.open = false;
        }
        Poll::Ready(result)
    }
}
