//! Failover before the first byte: a request whose upstream failed before anything reached the
//! client (the transport failed, or the engine answered 502/503/504, or 500 when
//! `routing.retry_on` lists it) is sent again to a different rank, and to a different engine
//! when the transport failed, up to `routing.max_attempts`. Never after a byte went to the client (this layer only ever sees
//! response heads), never on 4xx or the client's own errors, never for a client that left (its
//! future is dropped), never for a body too large to keep.
//!
//! Retries draw on a budget ([`super::budget`]: a share of the requests of the last 10 s plus a
//! floor of 2 per second), so when the whole fleet fails, retries cannot multiply the outage.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::{Request, Response};

use super::body::ProxyBody;
use super::budget::RetryBudget;
use super::error::ProxyError;
use super::layer::{Answer, Below};
use super::shared::Ctx;
use super::target::{LegHook, RetryUntil};
use super::trace::Traced;
use crate::policy::Avoid;
use crate::prompt::PromptTokens;
use crate::upstream::RequestBody;
use crate::worker::Member;
use std::sync::Arc;

#[derive(Clone)]
pub struct Retry<S> {
    inner: S,
    ctx: Ctx,
    policy: Arc<Policy>,
}

/// How far failover goes, one for the router: `routing.max_attempts`, the budget all
/// connections' retries draw on (`routing.retry_budget`), and whether an engine's 500 is
/// retried (`routing.retry_on`).
#[derive(Debug)]
pub struct Policy {
    max_attempts: u32,
    budget: RetryBudget,
    /// An HTTP engine's 500 is retried like a 502. Off by default: a 500 may be the request's
    /// own doing (a prompt that crashes the engine's handler), and would then be sent to every
    /// engine in turn. A gRPC engine's errors come as `grpc-status` (its UNAVAILABLE is retried
    /// as a 503 is).
    on_500: bool,
}

impl Policy {
    pub fn new(max_attempts: u32, share: f64, retry_on: &[u16]) -> Policy {
        Policy {
            max_attempts,
            budget: RetryBudget::new(share),
            on_500: retry_on.contains(&500),
        }
    }
}

impl Policy {
    /// A retry of a whole request (`disagg`'s second round) draws on the same budget.
    pub fn withdraw(&self) -> bool {
        self.budget.withdraw()
    }

    /// `routing.max_attempts`: a whole request's rounds (`disagg`'s SGLang failover) too.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }
}

impl<S> Retry<S> {
    pub fn new(inner: S, ctx: &Ctx, policy: &Arc<Policy>) -> Retry<S> {
        Retry {
            inner,
            ctx: ctx.clone(),
            policy: policy.clone(),
        }
    }
}

/// How many times one request is sent again after kept connections turned out closed: an
/// engine that closes them unannounced can have several dead ones kept.
const MAX_RESENDS: u32 = 3;

/// What a failed attempt rules out for the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ruled {
    /// The rank that answered 502-504 (or 500, by `routing.retry_on`).
    Worker,
    /// Every rank of the engine whose transport failed.
    Engine,
    /// Nothing: the engine had closed a kept connection and never had the request.
    Nothing,
}

/// Why an attempt may be worth another: the worker it failed on, and what it rules out.
/// `on_500`: an HTTP engine's 500 is one.
fn failed(
    result: &Result<Response<ProxyBody>, ProxyError>,
    grpc: bool,
    on_500: bool,
) -> Option<(Arc<Member>, Ruled)> {
    let retried = |status: u16| matches!(status, 502..=504) || (on_500 && !grpc && status == 500);
    match result {
        Ok(resp) if retried(super::grpc::answered(resp, grpc).as_u16()) => resp
            .body()
            .target
            .as_ref()
            .map(|t| (t.worker.clone(), Ruled::Worker)),
        Err(e) if e.retryable() => {
            let ruled = match e.root() {
                ProxyError::StaleConnection { .. } => Ruled::Nothing,
                _ => Ruled::Engine,
            };
            e.worker().map(|w| (w.clone(), ruled))
        }
        _ => None,
    }
}

impl<S> tower::Service<Request<RequestBody>> for Retry<S>
where
    S: Below<RequestBody> + Clone + Unpin,
{
    layer_types!(Retrying<S>);

    fn call(&mut self, req: Request<RequestBody>) -> Self::Future {
        self.policy.budget.deposit();
        // Only a body kept whole can be sent twice; the head is copied only then. Even with
        // retries off (max_attempts = 1): a kept connection the engine had closed is sent on
        // again.
        let again = req.body().replay().map(|body| {
            Box::new(Again {
                head: head(&req),
                body,
                inner: self.inner.clone(),
                ctx: self.ctx.clone(),
                policy: self.policy.clone(),
                // Engines ruled out before the first attempt (by model or route) stay out.
                avoid: req.extensions().get::<Avoid>().cloned().unwrap_or_default(),
                attempts: 1,
                resent: 0,
                last: None,
                until: req.extensions().get::<RetryUntil>().copied(),
            })
        });
        Retrying {
            attempt: self.inner.call(req),
            again,
        }
    }
}

/// A request's attempts. A future of its own rather than a boxed `async` block: one allocation
/// less on every request.
pub struct Retrying<S: Below<RequestBody>> {
    attempt: S::Future,
    /// What another attempt needs; `None` when the request cannot be sent twice. Boxed: inline
    /// it made `read`'s boxed future 1,368 bytes, past the largest size glibc keeps per thread
    /// for reuse (1,032), so every request's allocation of it went through the arena's bins
    /// (about 250 instructions more than a box of each, bench/instructions.sh).
    again: Option<Box<Again<S>>>,
}

pub struct Again<S> {
    head: Head,
    body: RequestBody,
    inner: S,
    ctx: Ctx,
    policy: Arc<Policy>,
    avoid: Avoid,
    attempts: u32,
    /// Times it was sent again after a kept connection turned out closed (not attempts).
    resent: u32,
    /// While a later attempt runs: the failure before it, which stands if it finds no rank.
    /// Boxed (only a retry fills it): inline, an answer made every request's `Again` 512 bytes
    /// larger (moved by value, and past the size glibc reuses per thread: see `again`).
    last: Option<Box<(Answer, u32)>>,
    /// No retry starts after this (a decode leg: its prefill server's lease on the blocks),
    /// and whether a 500 is retried until then.
    until: Option<RetryUntil>,
}

impl<S> Future for Retrying<S>
where
    S: Below<RequestBody> + Unpin,
{
    type Output = Answer;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Answer> {
        let this = self.get_mut();
        loop {
            let result = ready!(Pin::new(&mut this.attempt).poll(cx));
            let Some(a) = &mut this.again else {
                return Poll::Ready(attempted(result, 1));
            };
            if let Some((last, its_attempts)) = a.last.take().map(|b| *b) {
                // Sent again (no retry) when the attempts did not move.
                let retried = its_attempts < a.attempts;
                // No other rank to go to: the failure the client gets is the real one.
                if matches!(
                    result.as_ref().map_err(ProxyError::root),
                    Err(ProxyError::NoRank(_) | ProxyError::NoRankUnlisted { .. })
                ) {
                    return Poll::Ready(attempted(last, its_attempts));
                }
                if retried {
                    a.ctx.metrics.retried();
                }
            }
            let on_500 = a.policy.on_500 || a.until.is_some_and(|u| u.1);
            let Some((worker, ruled)) = failed(&result, a.ctx.grpc(), on_500) else {
                return Poll::Ready(attempted(result, a.attempts));
            };
            if ruled == Ruled::Nothing {
                // The engine never had it: sent again, which is no retry (no attempt, nothing
                // from the budget), a few times at most.
                if a.resent >= MAX_RESENDS {
                    return Poll::Ready(attempted(result, a.attempts));
                }
                a.resent += 1;
                let next = a.request();
                a.last = Some(Box::new((result, a.attempts)));
                this.attempt = a.inner.call(next);
                continue;
            }
            // A decode leg's 500 goes to one other decode rank, no further: when that one
            // fails too, the prefill that holds the blocks is the likelier culprit (dead, or its
            // KV unreachable), and `disagg` runs the request once more from another prefill,
            // which needs the retry budget more than a third decode rank does.
            let decode_500 = !a.policy.on_500
                && a.until.is_some_and(|u| u.1)
                && matches!(&result, Ok(r) if r.status() == http::StatusCode::INTERNAL_SERVER_ERROR);
            if a.attempts >= a.policy.max_attempts
                || (decode_500 && a.attempts >= 2)
                || a.until.is_some_and(|u| tokio::time::Instant::now() >= u.0)
            {
                return Poll::Ready(attempted(result, a.attempts));
            }
            if !a.policy.budget.withdraw() {
                a.ctx.metrics.retry_refused();
                return Poll::Ready(attempted(result, a.attempts));
            }
            match ruled {
                Ruled::Engine => {
                    // Every rank of its engine: the worker's engine in the fleet it was picked
                    // from (the worker's ranks are its engine's for as long as either lives).
                    let snap = a.ctx.table.snapshot.load();
                    match (snap.fleet.engines.iter())
                        .find(|e| e.members.iter().any(|m| m.key == worker.key))
                    {
                        Some(e) => a.avoid.engine(e.key),
                        None => a.avoid.worker(worker.key),
                    }
                }
                Ruled::Worker => a.avoid.worker(worker.key),
                // Sent again above.
                Ruled::Nothing => {}
            }
            let next = a.request();
            a.last = Some(Box::new((result, a.attempts)));
            a.attempts += 1;
            this.attempt = a.inner.call(next);
        }
    }
}

impl<S> Again<S> {
    /// The request once more, with what earlier attempts ruled out.
    fn request(&self) -> Request<RequestBody> {
        let body = (self.body.replay()).unwrap_or(RequestBody::Full(Default::default()));
        let mut next = rebuild(&self.head, body);
        next.extensions_mut().insert(self.avoid.clone());
        next
    }
}

/// Notes on an answer how many attempts it took (for the access log).
fn attempted(mut answer: Answer, attempts: u32) -> Answer {
    match &mut answer {
        Ok(resp) => resp.body_mut().holds.attempts = attempts,
        Err(ProxyError::At { attempts: n, .. }) => *n = attempts,
        Err(_) => {}
    }
    answer
}

/// The request head, for building later attempts.
struct Head {
    method: http::Method,
    uri: http::Uri,
    version: http::Version,
    headers: http::HeaderMap,
    /// A traced request's span: each attempt's span is its child.
    traced: Option<Traced>,
    /// The prompt's token ids, when `tokens` computed them.
    tokens: Option<PromptTokens>,
    /// A leg whose body is written for its rank (`disagg`): a resend is written again.
    hook: Option<LegHook>,
}

fn head(req: &Request<RequestBody>) -> Head {
    Head {
        method: req.method().clone(),
        uri: req.uri().clone(),
        version: req.version(),
        headers: req.headers().clone(),
        traced: req.extensions().get::<Traced>().cloned(),
        tokens: req.extensions().get::<PromptTokens>().cloned(),
        hook: req.extensions().get::<LegHook>().cloned(),
    }
}

fn rebuild(h: &Head, body: RequestBody) -> Request<RequestBody> {
    let mut req = Request::new(body);
    *req.method_mut() = h.method.clone();
    *req.uri_mut() = h.uri.clone();
    *req.version_mut() = h.version;
    *req.headers_mut() = h.headers.clone();
    if let Some(t) = &h.traced {
        req.extensions_mut().insert(t.clone());
    }
    if let Some(t) = &h.tokens {
        req.extensions_mut().insert(t.clone());
    }
    if let Some(hook) = &h.hook {
        req.extensions_mut().insert(hook.clone());
    }
    req
}
