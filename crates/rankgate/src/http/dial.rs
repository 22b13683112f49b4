//! How every client of rankgate's opens a connection: TCP, TLS for `https://`, and the whole
//! establishment under one deadline (`server.connect_timeout` for the engines).
//!
//! The TCP connector's own timeout covers the connect alone; an engine (or a balancer in front
//! of it) that accepts and then never answers the TLS ClientHello would otherwise hold the
//! request until its response timeout (30 min by default) and never be failed over. So the
//! deadline starts when the connect does and covers the TLS handshake too, as nginx's
//! `proxy_connect_timeout` and Envoy's `connect_timeout` do.
//!
//! An h2 client writes its preface and may send requests before the server has said anything,
//! so an h2 server that never sends its SETTINGS would hang every call on the connection just
//! the same. For h2 connections the same deadline also bounds the wait for the server's first
//! bytes: reads that find nothing by then fail the connection. HTTP/1 has no such exchange (the
//! server speaks only to answer a request, which the response timeout bounds).
//!
//! Expiry is an error of the connection, so callers see a transport failure: the proxy fails
//! over to another engine and counts it against this one.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A connection not established within the deadline.
#[derive(Debug, thiserror::Error)]
#[error("{authority}: no connection within {within:?} ({what})")]
pub struct ConnectTimeout {
    authority: String,
    within: Duration,
    /// What had not finished: the TCP connect and TLS handshake, or the h2 server's first frame.
    what: &'static str,
}

/// The connector of [`super::HttpClient`]: TCP (and TLS for `https://` URIs), established
/// within `within`.
#[derive(Clone)]
pub struct Dialer {
    inner: HttpsConnector<HttpConnector>,
    within: Duration,
    /// The connections speak h2: the server's first bytes are due within the deadline too.
    h2: bool,
}

impl Dialer {
    pub(super) fn new(inner: HttpsConnector<HttpConnector>, within: Duration, h2: bool) -> Self {
        Dialer { inner, within, h2 }
    }
}

impl std::fmt::Debug for Dialer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dialer")
            .field("within", &self.within)
            .field("h2", &self.h2)
            .finish()
    }
}

/// A stream as [`Dialer`] hands it over.
pub type Stream = MaybeHttpsStream<TokioIo<TcpStream>>;

impl tower::Service<Uri> for Dialer {
    type Response = Dialed<Stream>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Dialed<Stream>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let deadline = Instant::now() + self.within;
        let (within, h2) = (self.within, self.h2);
        let authority = uri.authority().map(|a| a.to_string()).unwrap_or_default();
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            match tokio::time::timeout_at(deadline, connecting).await {
                Ok(Ok(io)) => Ok(Dialed {
                    io,
                    silent: h2.then(|| {
                        Box::new(Silent {
                            timer: Box::pin(tokio::time::sleep_until(deadline)),
                            authority,
                            within,
                        })
                    }),
                }),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(Box::new(ConnectTimeout {
                    authority,
                    within,
                    what: "TCP connect and TLS handshake",
                }) as BoxError),
            }
        })
    }
}

/// An h2 server that has not spoken yet, and until when it may stay silent.
struct Silent {
    timer: Pin<Box<Sleep>>,
    authority: String,
    within: Duration,
}

/// A connection [`Dialer`] opened. For h2, reads fail once the deadline passes with nothing
/// read from the server; after the first read it is the stream itself.
pub struct Dialed<T> {
    io: T,
    /// Armed until the first read completes (h2 only; boxed: HTTP/1 connections never have it).
    silent: Option<Box<Silent>>,
}

impl<T> Dialed<T> {
    /// The stream itself, for a connection that has nothing left to watch (HTTP/1): the
    /// proxy's HTTP/1 connections carry every request's bytes, and go without the wrapper.
    pub fn into_inner(self) -> T {
        self.io
    }
}

impl<T: Read + Unpin> Read for Dialed<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        let Some(silent) = &mut this.silent else {
            return read;
        };
        if read.is_ready() {
            // Bytes, an end or an error: the server is no longer silent (an end or an error
            // fails the connection by itself).
            this.silent = None;
            return read;
        }
        match silent.timer.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                ConnectTimeout {
                    authority: silent.authority.clone(),
                    within: silent.within,
                    what: "the h2 server sent no SETTINGS",
                },
            ))),
        }
    }
}

impl<T: Write + Unpin> Write for Dialed<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
}

impl<T: Connection> Connection for Dialed<T> {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}
