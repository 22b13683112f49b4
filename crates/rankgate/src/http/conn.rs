//! One client connection as hyper serves it: the HTTP version (an h2 client's preface, else
//! HTTP/1), then hyper's HTTP/1 or h2 connection over the client's bytes.
//!
//! HTTP/1 heads are parsed into hyper's default header arrays, which live on the stack and
//! hold 100 lines. Real clients rarely send more, but some (tracing, gateways in front) do, and
//! rankgate serves up to [`MAX_HEADER_LINES`]. Asking hyper for that many allocates and fills
//! two 512-entry arrays for every request (about 6k instructions, bench/instructions.sh), so
//! the connection starts with the default and changes over only when a head needs it: hyper
//! refuses such a head with its own 431 before anything reaches the service, [`ClientIo`] keeps
//! that answer from the client, and the same bytes, which hyper read as a head and nothing
//! else, are parsed again by a connection built for long heads, which serves the rest of the
//! client's requests. A head past that limit gets the 431 from the second connection.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt};

use super::activity::Activity;
use super::limits::ServeOptions;
use super::watch::Graceful;

/// Most header lines one HTTP/1 request may carry (431 beyond).
pub const MAX_HEADER_LINES: usize = 512;

/// hyper's answer to a head with too many lines, up to its date.
const HYPER_431: &[u8] =
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\ndate: ";

/// What an h2 client sends first (RFC 9113, 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// hyper's connection builders for one listener.
pub struct Builders {
    /// HTTP/1 with hyper's default header arrays.
    h1: http1::Builder,
    /// HTTP/1 for heads of up to [`MAX_HEADER_LINES`] lines.
    h1_long: http1::Builder,
    pub h2: http2::Builder<TokioExecutor>,
}

impl Builders {
    pub fn new(opts: &ServeOptions) -> Builders {
        let mut h1 = http1::Builder::new();
        // No timer: the connection watch (watch.rs) owns the header and idle deadlines, and
        // with a timer hyper would arm its own header timeout (30 s unless told otherwise) for
        // every request, an allocation and a timer set and cancelled each time.
        h1.keep_alive(true).max_buf_size(opts.max_header_bytes);
        let mut h1_long = h1.clone();
        h1_long.max_headers(MAX_HEADER_LINES);
        let mut h2 = http2::Builder::new(TokioExecutor::new());
        h2.timer(TokioTimer::new())
            .keep_alive_interval(opts.h2_keepalive)
            .keep_alive_timeout(opts.h2_keepalive)
            .max_header_list_size(u32::try_from(opts.max_header_bytes).unwrap_or(u32::MAX));
        Builders { h1, h1_long, h2 }
    }
}

/// Reads until the bytes are, or cannot be, an h2 preface. Returns them, and whether they are.
///
/// An h2 client's preface must be followed by its SETTINGS frame (RFC 9113, 3.4), which real
/// clients send in the same packet: so the preface is taken as h2 only once a byte past it has
/// come. Until then the connection costs its socket and a small task, where hyper's h2
/// connection holds 24 KiB of buffers from the start (h2's write buffer and its reader's):
/// a flood of prefaces alone then weighs no more than one of silent sockets.
pub async fn sniff<T: AsyncRead + Unpin>(io: &mut T) -> std::io::Result<(Bytes, bool)> {
    let mut buf = [0u8; H2_PREFACE.len() + 16];
    let mut n = 0;
    while n < H2_PREFACE.len() {
        let k = io.read(&mut buf[n..H2_PREFACE.len()]).await?;
        if k == 0 || buf[n..n + k] != H2_PREFACE[n..n + k] {
            return Ok((Bytes::copy_from_slice(&buf[..n + k]), false));
        }
        n += k;
    }
    // The preface whole: what follows it (0 bytes: the client closed, which hyper then sees).
    let k = io.read(&mut buf[n..]).await?;
    Ok((Bytes::copy_from_slice(&buf[..n + k]), true))
}

impl<I, S, B> Graceful for http2::Connection<I, S, TokioExecutor>
where
    I: Read + Write + Unpin + Send + 'static,
    S: hyper::service::HttpService<hyper::body::Incoming, ResBody = B>,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn graceful(self: Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

/// An HTTP/1 client connection: hyper's, on the default header arrays until a head needs
/// more (see the module's note).
pub struct H1<T, S>
where
    S: hyper::service::HttpService<hyper::body::Incoming>,
{
    conn: Option<http1::Connection<ClientIo<T>, S>>,
    builders: Arc<Builders>,
    graceful: bool,
    /// Set by [`ClientIo`] when it holds back a 431 as hyper's own.
    held: Arc<AtomicBool>,
}

impl<T, S, B> H1<T, S>
where
    T: Read + Write + Unpin,
    S: hyper::service::HttpService<hyper::body::Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    pub fn new(builders: Arc<Builders>, io: ClientIo<T>, svc: S) -> H1<T, S> {
        H1 {
            held: io.held.clone(),
            conn: Some(builders.h1.serve_connection(io, svc)),
            builders,
            graceful: false,
        }
    }
}

impl<T, S, B> Future for H1<T, S>
where
    T: Read + Write + Unpin,
    S: hyper::service::HttpService<hyper::body::Incoming, ResBody = B> + Unpin,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Output = Result<(), hyper::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        loop {
            let Some(conn) = &mut this.conn else {
                return Poll::Ready(Ok(()));
            };
            let e = match Pin::new(conn).poll(cx) {
                Poll::Ready(Ok(())) => {
                    this.conn = None;
                    return Poll::Ready(Ok(()));
                }
                Poll::Ready(Err(e)) => e,
                // hyper ends the connection with its parse error in the poll that writes its
                // 431; one held back that hyper goes on from was not its refusal of a head:
                // the connection ends rather than hang with its answer half out.
                Poll::Pending if this.held.load(Relaxed) => {
                    tracing::warn!(
                        "client connection closed: an answer looked like hyper's own 431"
                    );
                    this.conn = None;
                    return Poll::Ready(Ok(()));
                }
                Poll::Pending => return Poll::Pending,
            };
            let Some(conn) = this.conn.take() else {
                return Poll::Ready(Err(e));
            };
            // Only hyper's 431 for a head, held back: the head is parsed again below.
            let parts = conn.into_parts();
            if !(e.is_parse_too_large() && parts.io.held.load(Relaxed)) {
                return Poll::Ready(Err(e));
            }
            let mut io = parts.io;
            io.reread(parts.read_buf);
            let mut long = this.builders.h1_long.serve_connection(io, parts.service);
            if this.graceful {
                Pin::new(&mut long).graceful_shutdown();
            }
            this.conn = Some(long);
        }
    }
}

impl<T, S, B> Graceful for H1<T, S>
where
    T: Read + Write + Unpin,
    S: hyper::service::HttpService<hyper::body::Incoming, ResBody = B> + Unpin,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: http_body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn graceful(mut self: Pin<&mut Self>) {
        self.graceful = true;
        if let Some(conn) = &mut self.conn {
            Pin::new(conn).graceful_shutdown();
        }
    }
}

/// A client connection's bytes as hyper reads and writes them: first the bytes read before
/// hyper had the connection, then the socket's. While its heads are parsed into hyper's
/// default arrays, it keeps hyper's own 431 from the client ([`H1`] parses that head again).
pub struct ClientIo<T> {
    io: T,
    replay: Bytes,
    activity: Arc<Activity>,
    /// Whether hyper's own 431 is held back.
    watch_431: bool,
    /// The service's 431s let through so far: a 431 status line is hyper's own when the
    /// service has given no more than these.
    passed_431: usize,
    /// One was: nothing more goes out, and the socket stays open, until the head is reparsed.
    held: Arc<AtomicBool>,
}

/// `io` for hyper, `replay` (the sniffed bytes) first; for HTTP/1, watching for hyper's 431.
pub fn client_io<T>(
    io: T,
    replay: Bytes,
    activity: Arc<Activity>,
    h1: bool,
) -> ClientIo<TokioIo<T>> {
    ClientIo {
        io: TokioIo::new(io),
        replay,
        activity,
        watch_431: h1,
        passed_431: 0,
        held: Arc::default(),
    }
}

impl<T> ClientIo<T> {
    /// Reads `head` (what hyper had read) again before anything else, watching no more.
    fn reread(&mut self, head: Bytes) {
        self.replay = match self.replay.is_empty() {
            true => head,
            false => [head, std::mem::take(&mut self.replay)].concat().into(),
        };
        self.watch_431 = false;
        self.held.store(false, Relaxed);
    }

    fn holding(&self) -> bool {
        self.held.load(Relaxed)
    }

    /// Whether `first`, the first buffer of a write, is hyper's own refusal of a head: its
    /// whole error head, byte for byte but the date, written while no request is active, and
    /// a 431 the service did not answer (its 431s, an engine's passed on among them, are
    /// counted before hyper writes them, and responses go out in order). Body bytes can begin
    /// with anything, so the shape alone would not do.
    fn refuses_head(&mut self, first: &[u8]) -> bool {
        if !(self.watch_431 && first.starts_with(b"HTTP/1.") && first.get(8..13) == Some(b" 431 "))
        {
            return false;
        }
        if self.passed_431 < self.activity.answered_431.load(Relaxed) {
            self.passed_431 += 1;
            return false;
        }
        // The date is 29 bytes (IMF-fixdate), then the blank line.
        first.len() == HYPER_431.len() + 29 + 4
            && first.starts_with(HYPER_431)
            && first.ends_with(b"\r\n\r\n")
            && self.activity.active.load(Relaxed) == 0
    }
}

impl<T: Read + Unpin> Read for ClientIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.replay.is_empty() {
            let n = self.replay.len().min(buf.remaining());
            buf.put_slice(&self.replay[..n]);
            self.replay.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: Write + Unpin> Write for ClientIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.holding() || self.refuses_head(buf) {
            self.held.store(true, Relaxed);
            return Poll::Ready(Ok(buf.len()));
        }
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.activity.wrote(&r, |&n| n > 0);
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let first = bufs
            .iter()
            .find(|b| !b.is_empty())
            .map_or(&[][..], |b| &b[..]);
        if self.holding() || self.refuses_head(first) {
            self.held.store(true, Relaxed);
            return Poll::Ready(Ok(bufs.iter().map(|b| b.len()).sum()));
        }
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.activity.wrote(&r, |&n| n > 0);
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.holding() {
            return Poll::Ready(Ok(()));
        }
        // A flush that cannot finish (TLS records waiting for the socket) is a stall too; one
        // that does says nothing of whether the client took anything.
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.activity.wrote(&r, |_| false);
        r
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.holding() {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
