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
use hyper::body::Incoming;
use hyper::client::conn::TrySendError;
use hyper_util::client::legacy::ResponseFuture;
use tokio::sync::Notify;
use tokio::time::Sleep;

use super::body::{BodyTooLarge, ClientBodyError, Ending};
use super::idle::{Idle, Sender};
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

    pub fn limit(&self) -> usize {
        self.limit
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
    /// The `Host` an HTTP/1 request to it carries, rendered once: the client would otherwise
    /// format it into a new string for every request.
    pub host: http::HeaderValue,
    /// `scheme://authority`, what a new connection is opened to.
    pub origin: http::Uri,
    pub grpc_authority: Option<http::uri::Authority>,
    pub slots: Slots,
    /// Its HTTP/1 connections between requests.
    pub idle: Idle,
    /// Its HTTP/1 connections open now, in use or idle.
    pub open: AtomicUsize,
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
            origin: http::Uri::try_from(format!("{}://{}", engine.scheme(), engine.authority))
                .unwrap_or(http::Uri::from_static("http://invalid.invalid:1")),
            grpc_authority: engine
                .grpc
                .as_deref()
                .and_then(|a| http::uri::Authority::try_from(a).ok()),
            slots: Slots::new(limits.connections),
            idle: Idle::default(),
            open: AtomicUsize::new(0),
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
    /// The HTTP/1 connection the request went out on, and the core whose idle list it goes
    /// back to once the response has ended cleanly ([`Slot::ended`]).
    sender: Option<Sender>,
    core: usize,
    ended: bool,
}

impl Slot {
    fn connection(engine: &Arc<EngineEntry>, core: usize) -> Slot {
        Slot {
            engine: engine.clone(),
            stream: None,
            sender: None,
            core,
            ended: false,
        }
    }

    fn stream(engine: &Arc<EngineEntry>, k: usize) -> Slot {
        Slot {
            engine: engine.clone(),
            stream: Some(k),
            sender: None,
            core: 0,
            ended: false,
        }
    }

    /// The response body was read to its end: the connection may carry another request.
    pub fn ended(&mut self) {
        self.ended = true;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        match self.stream {
            Some(k) => self.engine.conn.streams.give_back(k),
            None => {
                if let Some(sender) = self.sender.take().filter(|_| self.ended) {
                    self.engine.conn.idle.give_back(self.core, sender);
                }
                self.engine.conn.slots.give_back()
            }
        }
    }
}

/// One of an engine's HTTP/1 connections in [`EngineConn::open`], from the moment a request
/// decides to open it until it closes (or fails to open).
struct Counted(Arc<EngineEntry>);

impl Counted {
    /// Counts one more, whatever the limit.
    fn one_more(engine: &Arc<EngineEntry>) -> Counted {
        engine.conn.open.fetch_add(1, SeqCst);
        Counted(engine.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.conn.open.fetch_sub(1, SeqCst);
    }
}

/// Whether the engine's end of the connection had closed before it read the request: the
/// kernel reset the connection (a socket closed with nothing left unread answers data sent to
/// it with a reset). A plain close after the request went out is not taken for that: the engine
/// may have read the request and then closed (crashed, or a balancer in between dropped it),
/// and a generation must not run twice.
fn closed_under_us(e: &hyper::Error) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return matches!(io.kind(), BrokenPipe | ConnectionAborted | ConnectionReset);
        }
        src = s.source();
    }
    false
}

/// Turns a client error into the proxy's: the client's own body problems first, then the
/// transport.
fn classify(
    e: &(dyn std::error::Error + 'static),
    engine: &Arc<str>,
    max_body: usize,
) -> ProxyError {
    let mut src = Some(e);
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
        reason: crate::http::error_chain(e),
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
        let mut sending = Sending {
            ctx: self.0.clone(),
            target,
            guard: Some(guard),
            slot: None,
            timer: Some(timer),
            state: State::Done,
            reconnected: false,
            reused: false,
        };
        sending.state = if ctx.grpc() {
            // gRPC calls are streams on an engine's h2 connections, not connections.
            let k = sending.target.engine.conn.streams.take();
            sending.slot = Some(Slot::stream(&sending.target.engine, k));
            State::Grpc(ctx.grpc_clients[k].request(req))
        } else if sending.target.engine.conn.slots.try_take() {
            sending.slot = Some(Slot::connection(&sending.target.engine, ctx.conn().core));
            sending.start(req)
        } else {
            let engine = sending.target.engine.clone();
            State::Waiting(Box::new((
                Box::pin(async move { engine.conn.slots.take().await }),
                Some(req),
            )))
        };
        sending
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
    /// A connection taken idle closed before the request went out, and a new one was opened.
    reconnected: bool,
    /// The request went out on a connection that had carried requests before.
    reused: bool,
}

type Sent = Result<Response<Incoming>, TrySendError<Request<RequestBody>>>;

/// A connection being opened, and the request that waits for it. Boxed, as are all the
/// states but the usual one: the future is moved up the stack by value, and a request
/// carried in it made every move hundreds of bytes longer.
type Opening = (
    super::BoxFuture<Result<Sender, ProxyError>>,
    Option<Request<RequestBody>>,
);

enum State {
    /// Every connection slot to the engine is taken: waiting for one (rare, so boxed).
    Waiting(Box<(super::BoxFuture<()>, Option<Request<RequestBody>>)>),
    /// Holding a slot, opening a connection (no idle one was open).
    Connecting(Box<Opening>),
    /// Holding a slot and an idle connection that is not ready for a request yet (rare).
    Readying(Box<Option<(Sender, Request<RequestBody>)>>),
    /// The request is on the connection, waiting for the response head.
    Sending(Pin<Box<dyn Future<Output = Sent> + std::marker::Send>>),
    /// A gRPC call, a stream on one of the engine's h2 connections.
    Grpc(ResponseFuture),
    Done,
}

impl Sending {
    /// With a slot taken: the request on the core's idle connection, or on a new one.
    fn start(&mut self, req: Request<RequestBody>) -> State {
        let engine = &self.target.engine;
        let (conn, core) = (&engine.conn, self.ctx.conn().core);
        let mut idle = conn.idle.take(core, false);
        if idle.is_none() {
            // None idle on this core: one more connection while the engine has fewer than its
            // limit open, else another core's idle one.
            let under = |n: usize| (n < conn.slots.limit()).then_some(n + 1);
            if conn.open.fetch_update(SeqCst, SeqCst, under).is_ok() {
                return self.connect(req, Counted(engine.clone()));
            }
            idle = conn.idle.take(core, true);
        }
        match idle {
            // The usual case: the request goes out now.
            Some(sender) if sender.is_ready() => self.send(sender, req, true),
            Some(sender) => State::Readying(Box::new(Some((sender, req)))),
            // Every other one is closing: one over the limit until they are gone.
            None => self.connect(req, Counted::one_more(engine)),
        }
    }

    fn connect(&self, req: Request<RequestBody>, counted: Counted) -> State {
        let engine = self.target.engine.clone();
        let mut connector = self.ctx.connector.clone();
        let opened = async move {
            let failed = |what: &str, e: &(dyn std::error::Error + 'static)| ProxyError::Upstream {
                engine: engine.url.clone(),
                reason: format!("{what}: {}", crate::http::error_chain(e)),
            };
            let io = tower::Service::call(&mut connector, engine.conn.origin.clone())
                .await
                .map_err(|e| failed("connect", &*e))?;
            let (sender, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| failed("handshake", &e))?;
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(engine = %engine.url, error = %crate::http::error_chain(&e), "engine connection ended");
                }
                drop(counted);
            });
            Ok(sender)
        };
        State::Connecting(Box::new((Box::pin(opened), Some(req))))
    }

    /// `req` on `sender`'s connection; `reused`: one that carried requests before.
    fn send(&mut self, mut sender: Sender, req: Request<RequestBody>, reused: bool) -> State {
        self.reused = reused;
        let sent = sender.try_send_request(req);
        if let Some(slot) = &mut self.slot {
            slot.sender = Some(sender);
        }
        State::Sending(Box::pin(sent))
    }

    /// Still waiting, or `late` once the response timeout has passed.
    fn unless_late(&mut self, cx: &mut Context<'_>, late: ProxyError) -> Poll<super::Answer> {
        match self.timer.as_mut().map(|t| t.as_mut().poll(cx)) {
            Some(Poll::Pending) => Poll::Pending,
            _ => Poll::Ready(Err(late)),
        }
    }
}

impl Future for Sending {
    type Output = super::Answer;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<super::Answer> {
        let this = self.get_mut();
        let server = &this.ctx.cfg.server;
        let (timeout, max_body) = (server.response_timeout, server.max_body_bytes);
        let resp = loop {
            match &mut this.state {
                State::Waiting(waiting) => {
                    let (slot, req) = &mut **waiting;
                    if slot.as_mut().poll(cx).is_pending() {
                        let busy = ProxyError::EngineBusy {
                            limit: this.ctx.cfg.server.max_engine_connections,
                            waited: timeout,
                        };
                        return this.unless_late(cx, busy);
                    }
                    let core = this.ctx.conn().core;
                    this.slot = Some(Slot::connection(&this.target.engine, core));
                    let Some(req) = req.take() else {
                        return Poll::Ready(Err(ProxyError::Internal("request sent twice".into())));
                    };
                    this.state = this.start(req);
                }
                State::Connecting(opening) => {
                    let (opening, req) = &mut **opening;
                    let sender = match opening.as_mut().poll(cx) {
                        Poll::Ready(Ok(sender)) => sender,
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                        Poll::Pending => {
                            let late = ProxyError::Timeout(timeout);
                            return this.unless_late(cx, late);
                        }
                    };
                    let Some(req) = req.take() else {
                        return Poll::Ready(Err(ProxyError::Internal("request sent twice".into())));
                    };
                    this.state = this.send(sender, req, false);
                }
                State::Readying(ready) => {
                    let ready = &mut **ready;
                    let Some((sender, _)) = ready else {
                        return Poll::Ready(Err(ProxyError::Internal("request sent twice".into())));
                    };
                    match sender.poll_ready(cx) {
                        Poll::Ready(Ok(())) => {
                            let Some((sender, req)) = ready.take() else {
                                unreachable!()
                            };
                            this.state = this.send(sender, req, true);
                        }
                        // Closed since it was given back: the next idle one, or a new one.
                        Poll::Ready(Err(_)) => {
                            let Some((_, req)) = ready.take() else {
                                unreachable!()
                            };
                            this.state = this.start(req);
                        }
                        Poll::Pending => {
                            let late = ProxyError::Timeout(timeout);
                            return this.unless_late(cx, late);
                        }
                    }
                }
                State::Sending(sent) => match sent.as_mut().poll(cx) {
                    Poll::Ready(Ok(resp)) => break resp,
                    Poll::Ready(Err(mut e)) => {
                        if let Some(slot) = &mut this.slot {
                            slot.sender = None;
                        }
                        // The connection closed before the request went out (the engine
                        // dropped it while idle): once, on a new connection.
                        match e.take_message() {
                            Some(req) if !this.reconnected => {
                                this.reconnected = true;
                                let counted = Counted::one_more(&this.target.engine);
                                this.state = this.connect(req, counted);
                            }
                            _ => {
                                let engine = &this.target.engine.url;
                                let e = e.into_error();
                                let err = classify(&e, engine, max_body);
                                // A kept connection the engine had closed without saying so:
                                // the request never reached it.
                                if this.reused && closed_under_us(&e) {
                                    this.target.engine.conn.idle.clear();
                                    if let ProxyError::Upstream { engine, reason } = err {
                                        return Poll::Ready(Err(ProxyError::StaleConnection {
                                            engine,
                                            reason,
                                        }));
                                    }
                                }
                                return Poll::Ready(Err(err));
                            }
                        }
                    }
                    Poll::Pending => {
                        let late = ProxyError::Timeout(timeout);
                        return this.unless_late(cx, late);
                    }
                },
                State::Grpc(response) => match Pin::new(response).poll(cx) {
                    Poll::Ready(Ok(resp)) => break resp,
                    Poll::Ready(Err(e)) => {
                        let engine = &this.target.engine.url;
                        return Poll::Ready(Err(classify(&e, engine, max_body)));
                    }
                    Poll::Pending => {
                        let late = ProxyError::Timeout(timeout);
                        return this.unless_late(cx, late);
                    }
                },
                State::Done => {
                    return Poll::Ready(Err(ProxyError::Internal("polled after completion".into())))
                }
            }
        };
        this.state = State::Done;
        let server = &this.ctx.cfg.server;
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
