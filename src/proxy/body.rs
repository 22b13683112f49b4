//! The proxy's bodies: the request body sent upstream (streamed with a size cap, or rewritten
//! whole), and the response body that streams the engine's answer back while holding the
//! request's in-flight guard until its last frame.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::metrics::Metrics;
use crate::table::InFlight;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of a request sent to an engine.
#[derive(Debug)]
pub enum UpstreamBody {
    /// The client's body, passed through with a size cap.
    Stream {
        body: Incoming,
        remaining: usize,
    },
    Full(Option<Bytes>),
}

/// The client's body outgrew `server.max_body_bytes` while streaming.
#[derive(Debug, thiserror::Error)]
#[error("request body exceeds {0} bytes")]
pub struct BodyTooLarge(pub usize);

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            UpstreamBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            UpstreamBody::Stream { body, remaining } => match Pin::new(body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        if data.len() > *remaining {
                            return Poll::Ready(Some(Err(Box::new(BodyTooLarge(*remaining)))));
                        }
                        *remaining -= data.len();
                    }
                    Poll::Ready(Some(Ok(frame)))
                }
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(e)))),
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Full(b) => b.is_none(),
            UpstreamBody::Stream { body, .. } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            UpstreamBody::Stream { body, .. } => body.size_hint(),
        }
    }
}

/// Closes the books on one proxied request when the response body ends or is dropped.
#[derive(Debug)]
pub struct Done {
    pub(super) _guard: InFlight,
    pub(super) started: Instant,
    pub(super) metrics: Arc<Metrics>,
}

impl Drop for Done {
    fn drop(&mut self) {
        self.metrics.observe_latency(self.started.elapsed());
    }
}

/// The body of a response to the client.
#[derive(Debug)]
pub enum ProxyBody {
    Full(Option<Bytes>),
    /// The engine's body, streamed frame by frame; `done` is released at its end.
    Upstream {
        body: Incoming,
        done: Option<Box<Done>>,
    },
}

impl From<Bytes> for ProxyBody {
    fn from(b: Bytes) -> Self {
        ProxyBody::Full(Some(b))
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            ProxyBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            ProxyBody::Upstream { body, done } => {
                let r = Pin::new(body).poll_frame(cx);
                if matches!(r, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
                    done.take();
                }
                r
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Full(b) => b.is_none(),
            ProxyBody::Upstream { body, .. } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            ProxyBody::Upstream { body, .. } => body.size_hint(),
        }
    }
}
