//! The shape every layer below `respond` shares: what it answers ([`Answer`]), what it calls
//! ([`Below`]), and its future ([`Step`]: the layer below's as it is, or one of its own).

use std::future::Future;
use std::pin::Pin;

use http::header::{self, HeaderMap, HeaderName};
use http::{Request, Response};

use super::body::ProxyBody;
use super::error::ProxyError;

/// What every layer below `respond` answers.
pub type Answer = Result<Response<ProxyBody>, ProxyError>;

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// The pinning header, spelled as vLLM documents it (header names are case-insensitive; SGLang
/// reads the same name).
pub const RANK_HEADER: HeaderName = HeaderName::from_static("x-data-parallel-rank");
/// Names the virtual worker that served a response.
pub const WORKER_HEADER: HeaderName = HeaderName::from_static("x-rankgate-worker");

pub fn content_length(h: &HeaderMap) -> Option<u64> {
    h.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// The rest of the stack below a layer, for requests with body `B`.
pub trait Below<B>:
    tower::Service<
    Request<B>,
    Response = Response<ProxyBody>,
    Error = ProxyError,
    Future: Future<Output = Answer> + Send + Unpin + 'static,
>
{
}

impl<B, S> Below<B> for S where
    S: tower::Service<
        Request<B>,
        Response = Response<ProxyBody>,
        Error = ProxyError,
        Future: Future<Output = Answer> + Send + Unpin + 'static,
    >
{
}

/// A layer's answer: the layer below's future as it is (the usual path, no allocation), or a
/// boxed one of the layer's own (an error, or work the layer does after the call).
pub enum Step<F> {
    Below(F),
    Own(BoxFuture<Answer>),
}

impl<F> Step<F> {
    /// An answer that is already known.
    pub fn ready(answer: Answer) -> Step<F> {
        Step::Own(ready(answer))
    }
}

impl<F: Future<Output = Answer> + Unpin> Future for Step<F> {
    type Output = Answer;

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Answer> {
        match self.get_mut() {
            Step::Below(f) => Pin::new(f).poll(cx),
            Step::Own(f) => f.as_mut().poll(cx),
        }
    }
}

/// A future that is already done, boxed like the layers' own futures.
pub fn ready<T: Send + 'static>(v: T) -> BoxFuture<T> {
    Box::pin(std::future::ready(v))
}
