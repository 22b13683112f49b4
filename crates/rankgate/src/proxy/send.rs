//! Sending a request to its engine and streaming the answer back.
//!
//! The response must start within `server.response_timeout` (504 otherwise); the same timer then
//! bounds the gaps in the body (`server.stream_idle_timeout`). It is armed for the fleet's
//! first-byte bound first when that is shorter: a request without headers by then is hung, a
//! failure of its rank (`hung.rs`, which also judges requests whose client left).
//!
//! Connections to one engine are capped (`server.max_engine_connections`; over HTTP/1 that is
//! requests in flight on it), so a burst cannot open more sockets than the engine or this
//! process's file descriptors allow; a request waits for a slot within its response timeout
//! (one address holds at most half of them: `upstream::conn::Slots`).
//! Upstream failures are classified here, once: the client's broken body stays the client's.
//! The response leaves carrying its rank: the target and the request's in-flight mark in its
//! body, and the `x-rankgate-worker` header as far as `server.expose_worker` lets clients know.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{header, Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::TrySendError;
use hyper_util::client::legacy::ResponseFuture;
use tokio::time::Sleep;

use super::body::{Ending, ProxyBody};
use super::dial::Dial;
use super::error::ProxyError;
use super::guards::Slot;
use super::layer::WORKER_HEADER;
use super::pin::strip_hop_by_hop;
use super::shared::Ctx;
use super::target::Picked;
use crate::upstream::{handshake, BodyTooLarge, ClientBodyError, RequestBody, Sender};
use crate::worker::EngineEntry;

#[derive(Clone)]
pub struct Send {
    ctx: Ctx,
    dial: Arc<Dial>,
}

impl Send {
    pub fn new(ctx: &Ctx, dial: &Arc<Dial>) -> Send {
        Send {
            ctx: ctx.clone(),
            dial: dial.clone(),
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
                ClientBodyError::TooSlow(d) => ClientBodyError::TooSlow(*d),
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
        let (ctx, dial) = (&self.ctx, &self.dial);
        // One timer serves the whole exchange: the response timeout until the headers, then
        // (moved into the body) the stream idle timeout, so a request costs one timer.
        let first = match ctx.metrics.first_byte_bound.stall() {
            Some(bound) if bound < dial.response => bound,
            _ => dial.response,
        };
        let timer = Box::pin(tokio::time::sleep(first));
        let mut sending = Sending {
            ctx: ctx.clone(),
            dial: dial.clone(),
            target,
            guard: Some(guard),
            slot: None,
            timer: Some(timer),
            state: State::Done,
            reconnected: false,
            reused: false,
            first,
            hung: false,
            settled: false,
        };
        sending.state = if ctx.grpc() {
            // gRPC calls are streams on an engine's h2 connections, not connections.
            let k = sending.target.engine.conn.streams.take();
            sending.slot = Some(Slot::stream(&sending.target.engine, k));
            State::Grpc(dial.grpc_clients[k].request(req))
        } else if sending.target.engine.conn.slots.try_take(ctx.conn().client) {
            sending.slot = Some(Slot::connection(&sending.target.engine, ctx.conn()));
            sending.start(req)
        } else {
            let (engine, client) = (sending.target.engine.clone(), ctx.conn().client);
            State::Waiting(Box::new((
                Box::pin(async move { engine.conn.slots.take(client).await }),
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
    dial: Arc<Dial>,
    target: super::target::Target,
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
    /// What the timer was first armed for: the fleet's first-byte bound when shorter than the
    /// response timeout.
    first: std::time::Duration,
    /// The request was judged hung (no first byte by the bound).
    hung: bool,
    /// The future gave its answer: dropped before that, the client left.
    settled: bool,
}

impl Drop for Sending {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let started = (self.timer.as_ref()).and_then(|t| t.deadline().checked_sub(self.first));
        let busy = matches!(self.state, State::Waiting(_));
        let (metrics, policy) = (&self.ctx.metrics, self.dial.ejection);
        super::hung::left_before_first_byte(
            metrics,
            policy,
            &self.target,
            started,
            self.hung,
            busy,
        );
    }
}

type Sent = Result<Response<Incoming>, TrySendError<Request<RequestBody>>>;

/// A connection being opened, and the request that waits for it. Boxed, as are all the
/// states but the usual one: the future is moved up the stack by value, and a request
/// carried in it made every move hundreds of bytes longer.
type Opening = (
    super::layer::BoxFuture<Result<Sender, ProxyError>>,
    Option<Request<RequestBody>>,
);

enum State {
    /// Every connection slot to the engine is taken: waiting for one (rare, so boxed).
    Waiting(Box<(super::layer::BoxFuture<()>, Option<Request<RequestBody>>)>),
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
        let mut connector = self.dial.connector.clone();
        let cutoff = self.dial.cutoff.clone();
        let opened = async move {
            let failed = |what: &str, e: &(dyn std::error::Error + 'static)| ProxyError::Upstream {
                engine: engine.url.clone(),
                reason: format!("{what}: {}", crate::http::error_chain(e)),
            };
            // Established within the connect timeout (TLS included); HTTP/1 has nothing more to
            // watch on it.
            let io = tower::Service::call(&mut connector, engine.conn.origin.clone())
                .await
                .map_err(|e| failed("connect", &*e))?
                .into_inner();
            let io = cutoff.wrap(io);
            let (sender, conn) = handshake(io).await.map_err(|e| failed("handshake", &e))?;
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

    /// Still waiting, or `late` once the response timeout has passed. The first-byte bound
    /// passing first judges the request hung (unless it still waits for one of rankgate's own
    /// connection slots), and the timer runs on to the response timeout.
    fn unless_late(
        &mut self,
        cx: &mut Context<'_>,
        late: ProxyError,
    ) -> Poll<super::layer::Answer> {
        loop {
            let Some(timer) = self.timer.as_mut() else {
                return Poll::Ready(Err(late));
            };
            if timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let rest = self.dial.response.saturating_sub(self.first);
            if self.hung || rest.is_zero() {
                return Poll::Ready(Err(late));
            }
            self.hung = true;
            let at = timer.deadline() + rest;
            timer.as_mut().reset(at);
            if !matches!(self.state, State::Waiting(_)) {
                super::hung::judge(&self.ctx.metrics, self.dial.ejection, &self.target);
            }
        }
    }
}

impl Future for Sending {
    type Output = super::layer::Answer;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<super::layer::Answer> {
        let this = self.get_mut();
        let answer = this.step(cx);
        this.settled = answer.is_ready();
        answer
    }
}

impl Sending {
    fn step(&mut self, cx: &mut Context<'_>) -> Poll<super::layer::Answer> {
        let this = self;
        let (timeout, max_body) = (this.dial.response, this.dial.max_body);
        let resp = loop {
            match &mut this.state {
                State::Waiting(waiting) => {
                    let (slot, req) = &mut **waiting;
                    if slot.as_mut().poll(cx).is_pending() {
                        let busy = ProxyError::EngineBusy {
                            limit: this.target.engine.conn.slots.limit(),
                            waited: timeout,
                        };
                        return this.unless_late(cx, busy);
                    }
                    this.slot = Some(Slot::connection(&this.target.engine, this.ctx.conn()));
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
        let exposure = this.dial.exposure;
        exposure.scrub(&mut parts.headers);
        if let Some(shown) = exposure.worker(&this.target.worker) {
            parts.headers.insert(WORKER_HEADER, shown.clone());
        }
        let (idle, timer) = (this.dial.stream_idle, this.timer.take());
        let mut body = ProxyBody::upstream(body, ending, idle, timer, exposure);
        body.holds.connection = this.slot.take();
        body.holds.in_flight = this.guard.take();
        body.target = Some(this.target.clone());
        Poll::Ready(Ok(Response::from_parts(parts, body)))
    }
}

/// Every `IDLE_FOR` / 3 ([`crate::upstream::idle::IDLE_FOR`]), closes the idle connections of
/// every engine in the fleet that have waited that long, until `shutdown`: without traffic
/// nothing else would look at them.
pub async fn sweep_idle_connections(
    table: std::sync::Arc<crate::table::Table>,
    mut shutdown: crate::http::Shutdown,
) {
    let mut tick = tokio::time::interval(crate::upstream::idle::IDLE_FOR / 3);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = crate::http::shutdown_signalled(&mut shutdown) => return,
        }
        for engine in table.snapshot.load().fleet.engines.iter() {
            engine.conn.idle.sweep();
        }
    }
}
