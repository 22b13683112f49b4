//! The body of a request on its way to an engine: kept whole (so a retry can send it again
//! without copying), or streamed on with a size cap and a stall timeout when it is too large
//! to keep. The client's own failures while it streams are typed here, so whatever error the
//! upstream client wraps them in, they stay the client's.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The client's body outgrew `server.max_body_bytes` while streaming.
#[derive(Debug, thiserror::Error)]
#[error("request body exceeds {0} bytes")]
pub struct BodyTooLarge(pub usize);

/// The client's body broke (cut short, bad chunking) or stalled: the client's fault, never the
/// engine's, whatever error the upstream client wraps it in.
#[derive(Debug, thiserror::Error)]
pub enum ClientBodyError {
    #[error("reading the request body: {0}")]
    Broken(String),
    #[error("request body stalled: no data for {} ms (server.body_read_timeout)", .0.as_millis())]
    Stalled(Duration),
    #[error("request body not complete within {} ms (server.body_timeout)", .0.as_millis())]
    TooSlow(Duration),
}

/// How long a client may make rankgate wait for its body: any one wait
/// (`server.body_read_timeout`) and all of them (`server.body_timeout`, counted from the first
/// wait: a body already there when its head is read never reads the clock). Copied along with
/// the body, from the first read to the last, so a body read in several places still has one
/// deadline.
#[derive(Debug, Clone, Copy)]
pub struct BodyPace {
    /// The two bounds in milliseconds (what the config can say): a pace is captured by every
    /// request's read future, twice, and a `Duration` is twice the size.
    stall_ms: u32,
    whole_ms: u32,
    deadline: Option<Instant>,
}

impl BodyPace {
    pub fn new(stall: Duration, whole: Duration) -> BodyPace {
        let ms = |d: Duration| d.as_millis().clamp(1, u32::MAX as u128) as u32;
        BodyPace {
            stall_ms: ms(stall),
            whole_ms: ms(whole),
            deadline: None,
        }
    }

    /// A wait begins now: when it must end, and the client's error if it does.
    pub fn wait(&mut self) -> (Instant, ClientBodyError) {
        let now = Instant::now();
        let (stall, whole) = (
            Duration::from_millis(self.stall_ms.into()),
            Duration::from_millis(self.whole_ms.into()),
        );
        let deadline = *self.deadline.get_or_insert(now + whole);
        match now + stall {
            at if at <= deadline => (at, ClientBodyError::Stalled(stall)),
            _ => (deadline, ClientBodyError::TooSlow(whole)),
        }
    }
}

/// The body of a request sent to an engine.
#[derive(Debug)]
pub enum RequestBody {
    /// The whole body, as the client sent it: cloning it for a replay copies nothing.
    Full(Bytes),
    /// A body too large to keep: what was read of it, then the rest as it arrives.
    Stream(Box<StreamBody>),
}

#[derive(Debug)]
pub struct StreamBody {
    pub prefix: Option<Bytes>,
    pub body: Incoming,
    pub remaining: usize,
    pub pace: BodyPace,
    /// The wait in progress, and the error it ends in.
    pub timer: Option<(Pin<Box<Sleep>>, ClientBodyError)>,
}

impl RequestBody {
    /// A copy for another attempt, when the body is kept whole.
    pub fn replay(&self) -> Option<RequestBody> {
        match self {
            RequestBody::Full(b) => Some(RequestBody::Full(b.clone())),
            RequestBody::Stream(_) => None,
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let s = match self.get_mut() {
            RequestBody::Full(b) if b.is_empty() => return Poll::Ready(None),
            RequestBody::Full(b) => return Poll::Ready(Some(Ok(Frame::data(std::mem::take(b))))),
            RequestBody::Stream(s) => s,
        };
        if let Some(p) = s.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(p))));
        }
        match Pin::new(&mut s.body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                s.timer = None;
                if let Some(data) = frame.data_ref() {
                    if data.len() > s.remaining {
                        return Poll::Ready(Some(Err(Box::new(BodyTooLarge(s.remaining)))));
                    }
                    s.remaining -= data.len();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                Poll::Ready(Some(Err(Box::new(ClientBodyError::Broken(e.to_string())))))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                let pace = &mut s.pace;
                let (timer, _) = s.timer.get_or_insert_with(|| {
                    let (until, error) = pace.wait();
                    (Box::pin(tokio::time::sleep_until(until)), error)
                });
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => match s.timer.take() {
                        Some((_, error)) => Poll::Ready(Some(Err(Box::new(error)))),
                        None => Poll::Pending,
                    },
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Full(b) => b.is_empty(),
            RequestBody::Stream(s) => s.prefix.is_none() && s.body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Full(b) => SizeHint::with_exact(b.len() as u64),
            RequestBody::Stream(s) => {
                let mut h = s.body.size_hint();
                let p = s.prefix.as_ref().map_or(0, |p| p.len() as u64);
                h.set_lower(h.lower() + p);
                if let Some(u) = h.upper() {
                    h.set_upper(u + p);
                }
                h
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each wait ends at the stall limit until the whole-body deadline, counted from the first
    /// wait, comes sooner; then at that deadline, with its own error.
    #[tokio::test(start_paused = true)]
    async fn a_body_pace_ends_each_wait_at_the_nearer_limit() {
        let mut pace = BodyPace::new(Duration::from_secs(2), Duration::from_secs(5));
        let start = Instant::now();
        let (until, e) = pace.wait();
        assert_eq!(until, start + Duration::from_secs(2));
        assert!(matches!(e, ClientBodyError::Stalled(_)));
        tokio::time::advance(Duration::from_secs(4)).await;
        let (until, e) = pace.wait();
        assert_eq!(until, start + Duration::from_secs(5));
        assert!(matches!(e, ClientBodyError::TooSlow(_)));
        assert!(e.to_string().contains("server.body_timeout"), "{e}");
        // Copied along with the body, the clock keeps its deadline.
        let mut copy = pace;
        assert_eq!(copy.wait().0, start + Duration::from_secs(5));
    }
}
