//! The cut of every engine connection at once, when rankgate stops serving before its streams
//! end (the drain grace ran out, or a second signal came).
//!
//! Dropping connections cuts a stream in a way the client cannot tell from its end: its bytes
//! stop. Failing the engine side instead lets each response body see a broken engine stream and
//! end as a break after the first byte always ends (`proxy::body`): SSE with its final error
//! event, gRPC with a status. So every engine connection's IO is a [`CutIo`]: once the router's
//! [`Cutoff`] is cut, its reads fail with [`ShuttingDown`], and each connection's task is woken
//! so hyper sees it at once, even while the engine is silent.
//!
//! The cost on the request path is an atomic load and a waker registration per read; the list of
//! connections is touched only when one opens and when the cut comes.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};

use atomic_waker::AtomicWaker;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection};

/// The error a cut connection's reads fail with; [`is_shutdown`] finds it in an error chain.
#[derive(Debug, thiserror::Error)]
#[error("rankgate is shutting down")]
pub struct ShuttingDown;

/// One router's switch over all of its engine connections.
#[derive(Debug, Clone, Default)]
pub struct Cutoff(Arc<Shared>);

#[derive(Debug, Default)]
struct Shared {
    cut: AtomicBool,
    /// Every connection opened, as long as it lives: woken by the cut.
    links: Mutex<Vec<Weak<Link>>>,
}

/// What a connection shares with the cutoff: the task reading it.
#[derive(Debug)]
struct Link {
    reader: AtomicWaker,
}

impl Cutoff {
    /// Fails every engine connection's reads from now on, and wakes their tasks.
    pub fn cut(&self) {
        self.0.cut.store(true, Relaxed);
        let links = std::mem::take(&mut *self.0.links.lock().unwrap_or_else(|p| p.into_inner()));
        for link in links.iter().filter_map(Weak::upgrade) {
            link.reader.wake();
        }
    }

    /// Whether [`Cutoff::cut`] was called.
    pub fn is_cut(&self) -> bool {
        self.0.cut.load(Relaxed)
    }

    /// `io`, failing its reads once this cutoff is cut.
    pub fn wrap<T>(&self, io: T) -> CutIo<T> {
        let link = Arc::new(Link {
            reader: AtomicWaker::new(),
        });
        let mut links = self.0.links.lock().unwrap_or_else(|p| p.into_inner());
        // Closed connections are forgotten when the list has doubled since the last look, so
        // it stays within twice the connections open and each opening costs O(1) on average.
        if links.len() >= 16 && links.len().is_power_of_two() {
            links.retain(|l| l.strong_count() > 0);
        }
        links.push(Arc::downgrade(&link));
        CutIo {
            io,
            cutoff: self.0.clone(),
            link,
        }
    }

    /// `connector`, whose connections are [`CutIo`]s (for hyper's pooled clients).
    pub fn connector<C>(&self, connector: C) -> CutConnector<C> {
        CutConnector {
            inner: connector,
            cutoff: self.clone(),
        }
    }
}

/// Whether `e` or one of its sources is a cut connection's [`ShuttingDown`].
pub fn is_shutdown(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut src = Some(e);
    while let Some(s) = src {
        if s.is::<ShuttingDown>() {
            return true;
        }
        // An io::Error's `source()` skips the error it wraps: look inside it.
        if let Some(inner) = s.downcast_ref::<io::Error>().and_then(|io| io.get_ref()) {
            if inner.is::<ShuttingDown>() {
                return true;
            }
        }
        src = s.source();
    }
    false
}

/// An engine connection's IO that fails its reads once its [`Cutoff`] is cut.
#[derive(Debug)]
pub struct CutIo<T> {
    io: T,
    cutoff: Arc<Shared>,
    link: Arc<Link>,
}

impl<T: Read + Unpin> Read for CutIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        // Registered before the look, so a cut between the two still wakes this task.
        self.link.reader.register(cx.waker());
        if self.cutoff.cut.load(Relaxed) {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                ShuttingDown,
            )));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for CutIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<T: Connection> Connection for CutIo<T> {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}

/// A connector whose connections are [`CutIo`]s.
#[derive(Debug, Clone)]
pub struct CutConnector<C> {
    inner: C,
    cutoff: Cutoff,
}

impl<C> tower::Service<http::Uri> for CutConnector<C>
where
    C: tower::Service<http::Uri>,
    C::Future: Send + 'static,
{
    type Response = CutIo<C::Response>;
    type Error = C::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, C::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), C::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let (opening, cutoff) = (self.inner.call(uri), self.cutoff.clone());
        Box::pin(async move { Ok(cutoff.wrap(opening.await?)) })
    }
}

#[cfg(test)]
mod tests {
    use hyper_util::rt::TokioIo;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A read waiting on a silent peer fails with [`ShuttingDown`] as soon as the cut comes;
    /// the connection's writes still go out.
    #[tokio::test]
    async fn a_cut_fails_a_waiting_read_and_is_found_in_the_chain() {
        let (ours, mut theirs) = tokio::io::duplex(64);
        let cutoff = Cutoff::default();
        let mut io = TokioIo::new(cutoff.wrap(TokioIo::new(ours)));
        let reading = tokio::spawn(async move {
            let mut buf = [0u8; 8];
            let r = io.read(&mut buf).await;
            (r, io)
        });
        tokio::task::yield_now().await;
        assert!(!cutoff.is_cut());
        cutoff.cut();
        let (r, mut io) = reading.await.unwrap();
        let err = r.expect_err("the cut fails the read");
        assert!(is_shutdown(&err), "{err}");
        io.write_all(b"bye").await.unwrap();
        let mut got = [0u8; 3];
        theirs.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"bye");
        // Connections opened after the cut fail at once.
        let mut late = TokioIo::new(cutoff.wrap(TokioIo::new(tokio::io::empty())));
        assert!(late.read(&mut [0u8; 1]).await.is_err());
        let other = std::io::Error::other("engine reset");
        assert!(!is_shutdown(&other));
    }
}
