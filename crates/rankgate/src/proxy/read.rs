//! Reading the client's request body before anything is sent upstream.
//!
//! A body up to `routing.retry_buffer_bytes` is read whole and kept as the `Bytes` the client
//! sent (a body that arrives in one piece is not copied), so a failed attempt can be replayed to
//! another rank. A larger body streams, under the same size cap, and is not retried. Where the
//! fleet has SGLang engines every body is read whole (up to `server.max_body_bytes`) before the
//! pick, since the rank goes inside it: a slow upload then never holds a rank's in-flight slot. Every wait on the client is bounded by
//! `server.body_read_timeout`; a body that breaks or stalls is the client's error (400 / 408),
//! never the engine's.

use std::future::Future;
use std::task::Poll;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::Request;
use http_body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::error::ProxyError;
use super::layer::{content_length, Below};
use super::shared::Ctx;
use crate::upstream::{BodyPace, ClientBodyError, RequestBody, StreamBody};

#[derive(Clone)]
pub struct Read<S> {
    inner: S,
    ctx: Ctx,
    max_body: usize,
    keep: usize,
    stall: Duration,
    whole: Duration,
}

/// How a client's body is read: `server.max_body_bytes`, `routing.retry_buffer_bytes` (what is
/// kept whole for a replay), `server.body_read_timeout` and `server.body_timeout`.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_body: usize,
    pub retry_buffer: usize,
    pub stall: Duration,
    pub whole: Duration,
}

impl Limits {
    /// A new body's clock.
    pub fn pace(&self) -> BodyPace {
        BodyPace::new(self.stall, self.whole)
    }
}

impl<S> Read<S> {
    pub fn new(inner: S, ctx: &Ctx, limits: Limits) -> Read<S> {
        Read {
            inner,
            ctx: ctx.clone(),
            max_body: limits.max_body,
            // gRPC: the rank goes inside the message, which is read whole.
            // A connection opened before the fleet had such engines streams its bodies: `pick`
            // then reads the rest of one it pins in the body.
            keep: if ctx.grpc() || ctx.table.snapshot.load().fleet.http.pins_in_body {
                limits.max_body
            } else {
                limits.retry_buffer
            },
            stall: limits.stall,
            whole: limits.whole,
        }
    }
}

impl<S> tower::Service<Request<Incoming>> for Read<S>
where
    S: Below<RequestBody> + Clone + Send + 'static,
{
    layer_types!(super::layer::BoxFuture<super::layer::Answer>);

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        let length = content_length(req.headers());
        if length.is_some_and(|n| n > self.max_body as u64) {
            return super::layer::ready(Err(ProxyError::TooLarge(self.max_body)));
        }
        let mut inner = self.inner.clone();
        // Where the model decides the engine, or may name a route, the model is read from the
        // body: all of it. So is a response request's, which may refer to a stored response
        // (refused, in select).
        let whole = self.ctx.table.snapshot.load().catalog.reads_model()
            || req.uri().path() == "/v1/responses";
        let keep = if whole { self.max_body } else { self.keep };
        let (max, pace) = (self.max_body, BodyPace::new(self.stall, self.whole));
        // Taken apart here, not in the block: what the block captures it keeps for its whole
        // life, so the request whole and then its parts made it 264 bytes larger, past the
        // largest allocation glibc reuses per thread (1,032 bytes: every request's box of this
        // went through the arena's bins).
        let (parts, body) = req.into_parts();
        Box::pin(async move {
            let body = read(body, length, max, keep, pace).await?;
            inner.call(Request::from_parts(parts, body)).await
        })
    }
}

/// The body's next frame, or the client's error once `pace` runs out. The timer is armed only
/// when the client makes us wait: a body that is already here (the usual case) costs none.
async fn next_frame(
    body: &mut Incoming,
    pace: &mut BodyPace,
) -> Result<Option<Result<http_body::Frame<Bytes>, hyper::Error>>, ClientBodyError> {
    let mut next = std::pin::pin!(body.frame());
    let first = std::future::poll_fn(|cx| Poll::Ready(next.as_mut().poll(cx))).await;
    match first {
        Poll::Ready(frame) => Ok(frame),
        // Boxed: a timer inline made every request's read future 112 bytes larger, for the
        // rare client that makes us wait.
        Poll::Pending => {
            let (until, error) = pace.wait();
            Box::pin(tokio::time::timeout_at(until, next))
                .await
                .map_err(|_| error)
        }
    }
}

/// Reads `body` whole if it fits in `keep` bytes, else returns what it read and the rest as a
/// stream. `length` is the declared Content-Length, if any.
pub async fn read(
    mut body: Incoming,
    length: Option<u64>,
    max: usize,
    keep: usize,
    mut pace: BodyPace,
) -> Result<RequestBody, ProxyError> {
    let stream = |body, prefix, read: usize, pace| {
        Ok(RequestBody::Stream(Box::new(StreamBody {
            prefix,
            body,
            remaining: max - read,
            pace,
            timer: None,
        })))
    };
    if length.is_some_and(|n| n > keep as u64) {
        return stream(body, None, 0, pace);
    }
    let mut first: Option<Bytes> = None;
    let mut more: Option<BytesMut> = None;
    let mut total = 0usize;
    while !body.is_end_stream() {
        let frame = match next_frame(&mut body, &mut pace).await {
            Err(e) => return Err(e.into()),
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return Err(ClientBodyError::Broken(crate::http::error_chain(&e)).into())
            }
            Ok(Some(Ok(frame))) => frame,
        };
        // Trailers carry nothing an engine needs.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len();
        if total > max {
            return Err(ProxyError::TooLarge(max));
        }
        match (&mut first, &mut more) {
            (None, _) => first = Some(data),
            (Some(f), None) => {
                // A second piece: only now is a copy needed.
                let mut m = BytesMut::with_capacity(length.map_or(2 * total, |l| l as usize));
                m.extend_from_slice(f);
                m.extend_from_slice(&data);
                more = Some(m);
            }
            (Some(_), Some(m)) => m.extend_from_slice(&data),
        }
        if total > keep {
            let read: Bytes = more
                .take()
                .map_or_else(|| first.take().unwrap_or_default(), BytesMut::freeze);
            return stream(body, Some(read), total, pace);
        }
    }
    Ok(RequestBody::Full(match more {
        Some(m) => m.freeze(),
        None => first.unwrap_or_default(),
    }))
}

/// The whole body, reading the rest of one too large to have been kept.
pub async fn whole(body: RequestBody, max: usize) -> Result<bytes::Bytes, ProxyError> {
    match body {
        RequestBody::Full(b) => Ok(b),
        RequestBody::Stream(s) => {
            let StreamBody {
                prefix,
                body,
                remaining,
                pace,
                ..
            } = *s;
            let kept = max - remaining;
            let rest = match read(body, None, remaining, usize::MAX, pace).await? {
                RequestBody::Full(b) => b,
                RequestBody::Stream(_) => return Err(ProxyError::TooLarge(max)),
            };
            let Some(prefix) = prefix else {
                return Ok(rest);
            };
            let mut all = Vec::with_capacity(kept + rest.len());
            all.extend_from_slice(&prefix);
            all.extend_from_slice(&rest);
            Ok(all.into())
        }
    }
}
