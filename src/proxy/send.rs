//! Sending a request to its engine and streaming the answer back.
//!
//! The response must start within `server.response_timeout` (504 otherwise); the same timer then
//! bounds the gaps in the body (`server.stream_idle_timeout`).
//!
//! Connections to one engine are capped (`server.max_engine_connections`; over HTTP/1 that is
//! requests in flight on it), so a burst cannot open more sockets than the engine or this
//! process's file descriptors allow; a request waits for a slot within its response timeout.
//! Upstream failures are classified here, once: the client's broken body stays the client's.
//! The response leaves carrying its rank: the `x-rankgate-worker` header, the target and the
//! request's in-flight mark in its body.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{header, Request, Response};
use hyper_util::client::legacy::ResponseFuture;
use tokio::sync::Notify;
use tokio::time::Sleep;

use super::body::{BodyTooLarge, ClientBodyError, Ending};
use super::pin::strip_hop_by_hop;
use super::{Ctx, Picked, ProxyBody, ProxyError, RequestBody, WORKER_HEADER};
use crate::worker::EngineEntry;

#[derive(Clone)]
pub struct Send(Ctx);

impl Send {
    pub fn new(ctx: &Ctx) -> Send {
        Send(ctx.clone())
    }
}

/// The connection slots to one engine. Taking and giving back a slot is one atomic operation
/// on the request path; only a request that finds every slot taken waits, and only then is
/// anyone woken (tokio's `Semaphore` locks its waiter list on every release, from every core).
#[derive(Debug)]
pub struct Slots {
    used: AtomicUsize,
    limit: usize,
    /// Requests waiting for a slot, and their wake-up.
    waiting: AtomicUsize,
    freed: Notify,
}

impl Slots {
    pub fn new(limit: usize) -> Slots {
        Slots {
            used: AtomicUsize::new(0),
            limit,
            waiting: AtomicUsize::new(0),
            freed: Notify::new(),
        }
    }

    fn try_take(&self) -> bool {
        self.used
            .fetch_update(SeqCst, SeqCst, |n| (n < self.limit).then_some(n + 1))
            .is_ok()
    }

    async fn take(&self) {
        self.waiting.fetch_add(1, SeqCst);
        // Counted as waiting before looking, so a slot given back after the look wakes us.
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, SeqCst);
            }
        }
        let _waiting = Waiting(&self.waiting);
        loop {
            let freed = self.freed.notified();
            let mut freed = std::pin::pin!(freed);
            freed.as_mut().enable();
            if self.try_take() {
                return;
            }
            freed.await;
        }
    }

    fn give_back(&self) {
        self.used.fetch_sub(1, SeqCst);
        if self.waiting.load(SeqCst) > 0 {
            self.freed.notify_one();
        }
    }
}

/// Most h2 connections rankgate opens to one engine's gRPC service.
pub const MAX_GRPC_CONNECTIONS: usize = 64;

/// How many connections rankgate opens to one engine (`server.max_engine_connections`), and
/// how many gRPC calls one h2 connection carries before the next opens.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub connections: usize,
    pub streams_per_connection: usize,
}

impl ConnLimits {
    pub fn of(server: &crate::config::ServerConfig) -> ConnLimits {
        ConnLimits {
            connections: server.max_engine_connections,
            streams_per_connection: server.grpc_streams_per_connection,
        }
    }
}

impl Default for ConnLimits {
    fn default() -> ConnLimits {
        ConnLimits {
            connections: crate::config::DEFAULT_MAX_ENGINE_CONNECTIONS,
            streams_per_connection: crate::config::DEFAULT_GRPC_STREAMS_PER_CONNECTION,
        }
    }
}

/// What rankgate needs to reach one engine: its authorities, parsed once, and the slots and
/// streams its requests take.
#[derive(Debug)]
pub struct EngineConn {
    /// `http` or `https`, as the engine's URLs say.
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
    /// The `Host` an HTTP/1 request to it carries, rendered once: the client would otherwise
    /// format it into a new string for every request.
    pub host: http::HeaderValue,
    pub grpc_authority: Option<http::uri::Authority>,
    pub slots: Slots,
    pub streams: Streams,
}

impl EngineConn {
    pub fn new(engine: &crate::worker::Engine, limits: ConnLimits) -> EngineConn {
        let grpc_connections = match engine.grpc {
            Some(_) => limits.connections.min(MAX_GRPC_CONNECTIONS),
            None => 0,
        };
        EngineConn {
            scheme: engine.scheme(),
            host: host_header(&engine.authority, engine.tls()),
            // Validated at config load; a failure here would be a bug in validation.
            authority: http::uri::Authority::try_from(&*engine.authority)
                .unwrap_or(http::uri::Authority::from_static("invalid.invalid:1")),
            grpc_authority: engine
                .grpc
                .as_deref()
                .and_then(|a| http::uri::Authority::try_from(a).ok()),
            slots: Slots::new(limits.connections),
            streams: Streams::new(grpc_connections, limits.streams_per_connection),
        }
    }
}

/// `Host` for an HTTP/1 request to `authority`, as hyper's client writes it: the host, with the
/// port unless it is the scheme's default.
fn host_header(authority: &str, tls: bool) -> http::HeaderValue {
    let default = if tls { 443 } else { 80 };
    let shown = match http::uri::Authority::try_from(authority) {
        Ok(a) if a.port_u16() == Some(default) => a.host().to_string(),
        _ => authority.to_string(),
    };
    http::HeaderValue::try_from(shown).unwrap_or(http::HeaderValue::from_static("invalid.invalid"))
}

/// The h2 connections to one engine's gRPC service, by the calls each carries: a call goes on
/// the first connection under the stream limit, so one connection serves until the engine's
/// stream limit would make calls queue on it, and then the next one opens.
#[derive(Debug)]
pub struct Streams {
    active: Box<[AtomicUsize]>,
    limit: usize,
}

impl Streams {
    pub fn new(connections: usize, limit: usize) -> Streams {
        Streams {
            active: (0..connections).map(|_| AtomicUsize::new(0)).collect(),
            limit,
        }
    }

    /// The connection a new call takes. Every one at its limit: the least busy (the call
    /// queues there, in h2, for a stream).
    fn take(&self) -> usize {
        let under = |n: usize| (n < self.limit).then_some(n + 1);
        if let Some(k) = self
            .active
            .iter()
            .position(|a| a.fetch_update(SeqCst, SeqCst, under).is_ok())
        {
            return k;
        }
        let k = (0..self.active.len())
            .min_by_key(|&k| self.active[k].load(SeqCst))
            .unwrap_or(0);
        self.active[k].fetch_add(1, SeqCst);
        k
    }

    fn give_back(&self, k: usize) {
        self.active[k].fetch_sub(1, SeqCst);
    }
}

/// One taken connection slot (HTTP/1) or stream on a connection (gRPC), given back when
/// dropped (with the response body).
#[derive(Debug)]
pub struct Slot {
    engine: Arc<EngineEntry>,
    /// The gRPC connection the call is a stream on.
    stream: Option<usize>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        match self.stream {
            Some(k) => self.engine.conn.streams.give_back(k),
            None => self.engine.conn.slots.give_back(),
        }
    }
}

/// Turns a client error into the proxy's: the client's own body problems first, then the
/// transport.
fn classify(
    e: hyper_util::client::legacy::Error,
    engine: &Arc<str>,
    max_body: usize,
) -> ProxyError {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(s) = src {
        if let Some(c) = s.downcast_ref::<ClientBodyError>() {
            return ProxyError::ClientBody(match c {
                ClientBodyError::Broken(m) => ClientBodyError::Broken(m.clone()),
                ClientBodyError::Stalled(d) => ClientBodyError::Stalled(*d),
            });
        }
        if s.is::<BodyTooLarge>() {
            return ProxyError::TooLarge(max_body);
        }
        src = s.source();
    }
    ProxyError::Upstream {
        engine: engine.clone(),
        reason: crate::http::error_chain(&e),
    }
}

impl tower::Service<Request<Picked>> for Send {
    layer_types!(Sending);

    fn call(&mut self, req: Request<Picked>) -> Self::Future {
        let (parts, picked) = req.into_parts();
        let Picked {
            target,
            body,
            guard,
        } = picked;
        let req = Request::from_parts(parts, body);
        let ctx = &self.0;
        // One timer serves the whole exchange: the response timeout until the headers, then
        // (moved into the body) the stream idle timeout, so a request costs one timer.
        let timer = Box::pin(tokio::time::sleep(ctx.cfg.server.response_timeout));
        let mut slot = None;
        let state = if ctx.grpc() {
            // gRPC calls are streams on an engine's h2 connections, not connections.
            let k = target.engine.conn.streams.take();
            slot = Some(Slot {
                engine: target.engine.clone(),
                stream: Some(k),
            });
            State::Sending(ctx.grpc_clients[k].request(req))
        } else if target.engine.conn.slots.try_take() {
            slot = Some(Slot {
                engine: target.engine.clone(),
                stream: None,
            });
            State::Sending(ctx.conn().client.request(req))
        } else {
            let engine = target.engine.clone();
            State::Waiting(Box::new((
                Box::pin(async move { engine.conn.slots.take().await }),
                Some(req),
            )))
        };
        Sending {
            ctx: self.0.clone(),
            target,
            guard: Some(guard),
            slot,
            timer: Some(timer),
            state,
        }
    }
}

/// A request on its way to the engine. A future of its own rather than a boxed `async` block:
/// one allocation less on every request.
pub struct Sending {
    ctx: Ctx,
    target: super::Target,
    guard: Option<crate::table::InFlight>,
    /// The connection slot once taken: given back with the response body, or when this is
    /// dropped without one.
    slot: Option<Slot>,
    timer: Option<Pin<Box<Sleep>>>,
    state: State,
}

enum State {
    /// Every connection slot to the engine is taken: waiting for one (rare, so boxed).
    Waiting(Box<(super::BoxFuture<()>, Option<Request<RequestBody>>)>),
    /// Holding a slot, waiting for the response head.
    Sending(ResponseFuture),
}

impl Future for Sending {
    type Output = super::Answer;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<super::Answer> {
        let this = self.get_mut();
        let server = &this.ctx.cfg.server;
        let Some(timer) = &mut this.timer else {
            return Poll::Ready(Err(ProxyError::Internal("polled after completion".into())));
        };
        if let State::Waiting(waiting) = &mut this.state {
            let (slot, req) = &mut **waiting;
            match slot.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.slot = Some(Slot {
                        engine: this.target.engine.clone(),
                        stream: None,
                    });
                    let Some(req) = req.take() else {
                        return Poll::Ready(Err(ProxyError::Internal("request sent twice".into())));
                    };
                    this.state = State::Sending(this.ctx.conn().client.request(req));
                }
                Poll::Pending => {
                    return match timer.as_mut().poll(cx) {
                        Poll::Ready(()) => Poll::Ready(Err(ProxyError::EngineBusy {
                            limit: server.max_engine_connections,
                            waited: server.response_timeout,
                        })),
                        Poll::Pending => Poll::Pending,
                    };
                }
            }
        }
        let State::Sending(response) = &mut this.state else {
            return Poll::Pending;
        };
        let resp = match Pin::new(response).poll(cx) {
            Poll::Ready(Ok(resp)) => resp,
            Poll::Ready(Err(e)) => {
                let engine = &this.target.engine.url;
                return Poll::Ready(Err(classify(e, engine, server.max_body_bytes)));
            }
            Poll::Pending => {
                return match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        Poll::Ready(Err(ProxyError::Timeout(server.response_timeout)))
                    }
                    Poll::Pending => Poll::Pending,
                };
            }
        };
        let (mut parts, body) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        let ending = if this.ctx.grpc() {
            Ending::GrpcStatus
        } else if parts
            .headers
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"))
        {
            Ending::SseEvent
        } else {
            Ending::Cut
        };
        parts
            .headers
            .insert(WORKER_HEADER, this.target.worker.header.clone());
        let mut body =
            ProxyBody::upstream(body, ending, server.stream_idle_timeout, this.timer.take());
        body.holds.connection = this.slot.take();
        body.holds.in_flight = this.guard.take();
        body.target = Some(this.target.clone());
        Poll::Ready(Ok(Response::from_parts(parts, body)))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::{host_header, Slots};

    #[test]
    fn the_host_header_is_the_engines_as_hyper_would_write_it() {
        assert_eq!(host_header("10.0.0.7:8000", false), "10.0.0.7:8000");
        assert_eq!(host_header("vllm:80", false), "vllm");
        assert_eq!(host_header("vllm:443", true), "vllm");
        assert_eq!(host_header("vllm:443", false), "vllm:443");
        assert_eq!(host_header("[::1]:8000", false), "[::1]:8000");
    }

    #[tokio::test]
    async fn a_full_engine_makes_the_next_request_wait_until_a_slot_is_given_back() {
        let slots = Arc::new(Slots::new(2));
        assert!(slots.try_take() && slots.try_take());
        assert!(!slots.try_take(), "at the cap");
        let waiter = {
            let slots = slots.clone();
            tokio::spawn(async move { slots.take().await })
        };
        // Still waiting: nothing was given back.
        let waiting = tokio::time::timeout(Duration::from_millis(50), async {
            while slots.waiting.load(super::SeqCst) == 0 {
                tokio::task::yield_now().await;
            }
        })
        .await;
        assert!(waiting.is_ok(), "the waiter counts itself");
        assert!(!waiter.is_finished());
        slots.give_back();
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken by the slot given back")
            .unwrap();
        assert!(!slots.try_take(), "the waiter holds the freed slot");
        assert_eq!(slots.waiting.load(super::SeqCst), 0);
        slots.give_back();
        slots.give_back();
        assert!(slots.try_take() && slots.try_take() && !slots.try_take());
    }
}
