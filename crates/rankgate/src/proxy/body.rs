//! The response body: the engine's answer streamed back to the client, bounded by the stream
//! idle timeout, holding the request's guards ([`Holds`]) until its last frame (or rankgate's
//! own answer). The request body is [`crate::upstream::RequestBody`].
//!
//! A stream that breaks after its first byte can no longer become an error status, so when it is
//! an SSE stream it ends with one final `data: {"error": ...}` event: clients (the OpenAI SDKs
//! among them) then raise an error instead of hanging or taking a cut answer as complete.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use super::error::StreamError;
use super::exposure::Exposure;
use super::grpc::requests::Held;
use super::grpc::status::status_headers;
use super::guards::{Admitted, BreakWatch, ClientStream, Done, Slot};
use super::target::Target;
use crate::table::InFlight;
use crate::upstream::BoxError;

/// What a response holds until its body ends; each layer of the stack puts its own guard here.
#[derive(Debug, Default)]
pub struct Holds {
    /// The request in flight on its rank (pick).
    pub in_flight: Option<InFlight>,
    /// A slot under `server.max_in_flight` (admission).
    pub admitted: Option<Admitted>,
    /// A request of its client address's, under `server.max_streams_per_client` (respond).
    pub client: Option<ClientStream>,
    /// A connection slot under `server.max_engine_connections` (send).
    pub connection: Option<Slot>,
    /// Time to first byte and duration (respond).
    pub done: Option<Done>,
    /// Attempts on engines this answer took (retry); 0 until set.
    pub attempts: u32,
    /// Told how the upstream body ended: cleanly or broken (outlier accounting).
    pub on_break: Option<BreakWatch>,
    /// The gRPC request id's entry, for Abort (grpc track).
    pub request_id: Option<Held>,
    /// A traced request's span, which ends with the body (trace).
    pub span: Option<Box<tracing::Span>>,
    /// A disaggregated request's prefill leg, on its decode leg's answer (disagg; moved into
    /// `done` by respond).
    pub prefill: Option<Box<super::target::PrefillLeg>>,
    /// The tenant charged for the output as it streams (flow control).
    pub flow: Option<Box<super::flow::charge::Charge>>,
}

/// The body of a response to the client.
#[derive(Debug)]
pub struct ProxyBody {
    kind: Kind,
    pub holds: Holds,
    /// The rank that answered, once `pick` has one.
    pub target: Option<Target>,
}

#[derive(Debug)]
enum Kind {
    Full(Option<Bytes>),
    /// rankgate's own gRPC answer: one message, then the trailers with its status. Boxed, as
    /// the upstream body is: every answer is moved up the stack by value, and an inline map
    /// made each of those moves 88 bytes longer.
    Grpc(Option<Bytes>, Option<Box<http::HeaderMap>>),
    Upstream(Box<Upstream>),
}

/// How a stream that breaks after its first byte ends for the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Cut: the client sees the connection or stream fail.
    Cut,
    /// SSE: one final `data: {"error": ...}` event.
    SseEvent,
    /// gRPC: trailers with a status (UNAVAILABLE, or DEADLINE_EXCEEDED when idle) naming the
    /// worker, as a gRPC client expects any call to end.
    GrpcStatus,
}

#[derive(Debug)]
struct Upstream {
    body: Option<Incoming>,
    ending: Ending,
    idle: Duration,
    /// When the last frame came, once the idle timer is armed.
    last_frame: Option<Instant>,
    /// Armed for the idle timeout only once the engine makes the client wait, so a body that
    /// is already there costs no timer work (nor a look at the clock). May come from `send`,
    /// which used it for the response timeout, until it is reset for the body.
    timer: Option<Pin<Box<Sleep>>>,
    /// The waker the timer holds from its last poll. While it is the task's and the timer has
    /// not fired, a wait for the next chunk leaves the timer alone: polling it again cost about
    /// 450 instructions per relayed SSE event (bench/instructions.sh).
    timer_waker: Option<std::task::Waker>,
    /// What the client is told of the engine when the stream is cut (`server.expose_worker`).
    exposure: Exposure,
}

impl ProxyBody {
    /// An engine's response body, streamed back with a limit on the gap between chunks.
    pub fn upstream(
        body: Incoming,
        ending: Ending,
        idle: Duration,
        timer: Option<Pin<Box<Sleep>>>,
        exposure: Exposure,
    ) -> ProxyBody {
        ProxyBody {
            kind: Kind::Upstream(Box::new(Upstream {
                body: Some(body),
                ending,
                idle,
                last_frame: None,
                timer,
                timer_waker: None,
                exposure,
            })),
            holds: Holds::default(),
            target: None,
        }
    }

    /// Ends the stream: releases the engine's body and every guard, and says why.
    fn broke(&mut self, err: StreamError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let idle = matches!(err, StreamError::Idle(_));
        // rankgate's own shutdown is no verdict on the engine: the watch is dropped unjudged.
        if let Some(watch) = self.holds.on_break.take() {
            if matches!(err, StreamError::ShuttingDown) {
                watch.shutdown();
            } else {
                watch.fire(idle);
            }
        }
        if let Some(done) = &self.holds.done {
            done.ctx.metrics.stream_cut(idle);
        }
        tracing::warn!(error = %err, "stream cut after its first byte");
        let Kind::Upstream(up) = &mut self.kind else {
            self.holds = Holds::default();
            return Poll::Ready(None);
        };
        let worker = self.holds.in_flight.as_ref().map(|g| &**g.member());
        let message = up.exposure.stream(worker, &err);
        self.holds = Holds::default();
        up.body = None;
        if up.ending == Ending::GrpcStatus {
            let code = match err {
                StreamError::Idle(_) => tonic::Code::DeadlineExceeded,
                StreamError::Broken(_) | StreamError::ShuttingDown => tonic::Code::Unavailable,
            };
            let trailers = status_headers(code, &message);
            return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
        }
        if up.ending == Ending::SseEvent {
            let (status, kind) = match err {
                StreamError::Idle(_) => (StatusCode::GATEWAY_TIMEOUT, "UpstreamError"),
                StreamError::Broken(_) => (StatusCode::BAD_GATEWAY, "UpstreamError"),
                StreamError::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "ShuttingDown"),
            };
            let json = crate::http::error_json(status, kind, &message);
            let mut event = Vec::with_capacity(json.len() + 8);
            event.extend_from_slice(b"data: ");
            event.extend_from_slice(&json);
            event.extend_from_slice(b"\n\n");
            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))));
        }
        Poll::Ready(Some(Err(Box::new(err))))
    }
}

impl ProxyBody {
    /// No body at all.
    pub fn empty() -> ProxyBody {
        ProxyBody {
            kind: Kind::Full(None),
            holds: Holds::default(),
            target: None,
        }
    }

    /// One gRPC message, then `trailers`.
    pub fn grpc(message: Option<Bytes>, trailers: http::HeaderMap) -> ProxyBody {
        ProxyBody {
            kind: Kind::Grpc(message, Some(Box::new(trailers))),
            holds: Holds::default(),
            target: None,
        }
    }
}

impl From<Bytes> for ProxyBody {
    fn from(b: Bytes) -> Self {
        ProxyBody {
            kind: Kind::Full(Some(b)),
            holds: Holds::default(),
            target: None,
        }
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let up = match &mut this.kind {
            Kind::Full(b) => return Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Kind::Grpc(message, trailers) => {
                let frame = match message.take() {
                    Some(m) => Frame::data(m),
                    None => return Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(*t)))),
                };
                return Poll::Ready(Some(Ok(frame)));
            }
            Kind::Upstream(up) => up,
        };
        let Some(body) = &mut up.body else {
            return Poll::Ready(None);
        };
        match Pin::new(&mut *body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(last) = &mut up.last_frame {
                    *last = Instant::now();
                }
                if let Some(done) = &mut this.holds.done {
                    done.passed(&frame);
                }
                if let Some(charge) = &this.holds.flow {
                    charge.passed(&frame);
                }
                // A gRPC call that failed after its first byte says so in its trailers.
                let unavailable = up.ending == Ending::GrpcStatus
                    && frame
                        .trailers_ref()
                        .and_then(|t| t.get("grpc-status"))
                        .is_some_and(|s| s == "14");
                if unavailable {
                    if let Some(watch) = this.holds.on_break.take() {
                        watch.failed(503);
                    }
                }
                // The last frame: hyper may not poll again once the body says it has ended.
                if body.is_end_stream() {
                    if let Some(watch) = this.holds.on_break.take() {
                        watch.ended();
                    }
                    if let Some(slot) = &mut this.holds.connection {
                        slot.ended();
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) if crate::upstream::cutoff::is_shutdown(&e) => {
                this.broke(StreamError::ShuttingDown)
            }
            Poll::Ready(Some(Err(e))) => {
                this.broke(StreamError::Broken(crate::http::error_chain(&e)))
            }
            Poll::Ready(None) => {
                if let Some(watch) = this.holds.on_break.take() {
                    watch.ended();
                }
                if let Some(slot) = &mut this.holds.connection {
                    slot.ended();
                }
                up.body = None;
                this.holds = Holds::default();
                Poll::Ready(None)
            }
            Poll::Pending => {
                let idle = up.idle;
                let last = match up.last_frame {
                    Some(last) => last,
                    None => {
                        let now = Instant::now();
                        up.last_frame = Some(now);
                        up.timer_waker = None;
                        match &mut up.timer {
                            Some(t) => t.as_mut().reset(now + idle),
                            None => up.timer = Some(Box::pin(tokio::time::sleep_until(now + idle))),
                        }
                        now
                    }
                };
                let Some(timer) = &mut up.timer else {
                    return Poll::Pending;
                };
                let holds_ours = (up.timer_waker.as_ref()).is_some_and(|w| w.will_wake(cx.waker()));
                if holds_ours && !timer.is_elapsed() {
                    return Poll::Pending;
                }
                // The deadline moves lazily: only when the timer fires is it checked against
                // the last frame, so a busy stream costs no timer update per chunk.
                while timer.as_mut().poll(cx).is_ready() {
                    let due = last + idle;
                    if Instant::now() >= due {
                        return this.broke(StreamError::Idle(idle));
                    }
                    timer.as_mut().reset(due);
                }
                up.timer_waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full(b) => b.is_none(),
            Kind::Grpc(m, t) => m.is_none() && t.is_none(),
            Kind::Upstream(up) => up.body.as_ref().is_none_or(|b| b.is_end_stream()),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Kind::Grpc(..) => SizeHint::default(),
            Kind::Upstream(up) => up
                .body
                .as_ref()
                .map_or_else(SizeHint::default, |b| b.size_hint()),
        }
    }
}
