//! The accept loop: HTTP/1.1 and h2 on one port (cleartext, or TLS with ALPN), every client
//! connection bounded.
//!
//! A front door that waits forever on its clients is one a few thousand idle sockets can take
//! down, so each connection lives under a deadline: its first request's headers must arrive
//! within `header_read_timeout` (the HTTP version sniff and the h2 preface included, which hyper's
//! own HTTP/1 header timeout does not cover), and a connection with no request in progress is
//! closed after `idle_timeout`. One client address (an IPv6 prefix) holds at most
//! `max_connections_per_client` connections, and a full table (`max_connections`, whose
//! default leaves file descriptors for the upstream connections and the admin listener) first
//! closes its oldest connection that has not sent a request yet, else (gracefully) its longest
//! idle one between requests; only a table of connections all in a request pauses accepting
//! ([`super::admission`]). Shutdown stops accepting, lets requests and streams in flight finish
//! for the drain grace, then returns.

use std::cell::RefCell;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::time::Instant;

use super::activity::{ActiveGuard, Activity};
use super::admission::{Place, Replace, Ticket, REPLACEABLE_AFTER};
use super::conn::{self, Builders};
use super::limits::{Door, ServeOptions};
use super::shutdown::{shutdown_signalled, Shutdown};
use super::watch::{drive, Watch};

/// Serves a handler function with the default limits; see [`serve_with`].
pub async fn serve<F, Fut, B>(listener: TcpListener, handler: F, shutdown: Shutdown)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + Unpin + 'static,
    Fut: Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    serve_with(
        listener,
        move |_| tower::service_fn(handler.clone()),
        shutdown,
        ServeOptions::default(),
    )
    .await
}

/// Serves on `listener` (HTTP/1.1 and h2 on the same port, over TLS when `opts.tls` is set)
/// until `shutdown`, then waits up to the drain grace for requests in flight to finish. Each
/// connection gets its own service from `make`, told the client's address (hyper clones it for
/// every request; see [`crate::proxy::Ctx`]).
pub async fn serve_with<M, S, B>(
    listener: TcpListener,
    make: M,
    mut shutdown: Shutdown,
    opts: ServeOptions,
) where
    S: tower::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + Unpin
        + 'static,
    S::Future: Send + 'static,
    M: Fn(std::net::SocketAddr) -> S,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let builders = Arc::new(Builders::new(&opts));
    // Every connection task holds a sender; the drain below ends when all are gone.
    let (open, mut all_closed) = tokio::sync::mpsc::channel::<()>(1);
    // Told when the drain grace expires: connections still open then are cut.
    let (cut, cut_rx) = watch::channel(false);
    let door = (opts.door.clone()).unwrap_or_else(|| Arc::new(Door::new(&opts)));
    let Door {
        max_connections,
        slots,
        admission,
        client_full,
        accept_errors,
        cap_reached,
    } = &*door;
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors must not end the server, nor flood the log.
                    if let Some(held) = accept_errors.allow() {
                        tracing::warn!(error = %e, repeated = held, "accept failed");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown_signalled(&mut shutdown) => break,
        };
        let activity = Arc::new(Activity::new());
        // For send_timeout: whether the client acknowledges what is sent (watch.rs).
        activity.fd.store(
            std::os::fd::AsRawFd::as_raw_fd(&stream),
            std::sync::atomic::Ordering::Relaxed,
        );
        let client = admission.key(peer.ip());
        let place = admission.admit(client, &activity);
        if !matches!(place, Place::Now) {
            if let Some(held) = client_full.allow() {
                tracing::warn!(
                    client = %peer.ip(),
                    max_connections_per_client = admission.per_client,
                    repeated = held,
                    "client address at its connection limit: new connections wait for a place, or are closed"
                );
            }
        }
        if let Place::Refused = place {
            continue;
        }
        let ticket = Ticket::new(admission, client, &activity);
        // The slot is taken once a client is there, never while waiting for one: with several
        // listeners on one door, a slot held by an idle listener was a slot the busy ones
        // lacked (below the cap, clients waited; with a cap under the core count, forever). At
        // the cap the oldest connection with no request yet makes room; with none, this client
        // waits here, accepted but not served, and accepting pauses: the kernel's backlog
        // holds the next ones, and at most one descriptor per listener is held beyond the cap.
        let slot = match slots.clone().try_acquire_owned() {
            Ok(s) => s,
            Err(_) => {
                let mut replaced = admission.replace_oldest();
                if let Some(held) = cap_reached.allow() {
                    let outcome = match replaced {
                        Replace::Done => {
                            "a connection with no request yet, or idle between requests, closed"
                        }
                        Replace::Later(_) => {
                            "accepting paused until a connection with no request yet has had its 250 ms"
                        }
                        Replace::AllServing => "all serving, accepting paused",
                    };
                    tracing::warn!(
                        max_connections,
                        repeated = held,
                        "connection limit reached: {outcome}"
                    );
                }
                // Paused: a slot given back, or the oldest connection with no request yet
                // becoming replaceable, whichever comes first. Never waiting on the slot alone:
                // the connection told to close may have begun a request meanwhile (it then
                // stays), and with several listeners on one door the others' accept loops take
                // slots too, so a look again after a while keeps the door turning over.
                let slot = loop {
                    let retry = match replaced {
                        Replace::Later(t) => t,
                        Replace::Done | Replace::AllServing => Instant::now() + REPLACEABLE_AFTER,
                    };
                    tokio::select! {
                        s = slots.clone().acquire_owned() => break s.ok(),
                        _ = shutdown_signalled(&mut shutdown) => break None,
                        () = tokio::time::sleep_until(retry) => {
                            replaced = admission.replace_oldest();
                        }
                    }
                };
                match slot {
                    Some(s) => s,
                    None => break,
                }
            }
        };
        // Only now may a full door close it for a newer connection: closing it before it holds
        // a slot would free none.
        admission.holds_slot(&activity);
        let _ = stream.set_nodelay(true);
        let svc = Tracked {
            inner: RefCell::new(make(peer)),
            activity: activity.clone(),
        };
        let (builders, open, opts, cut, shutdown) = (
            builders.clone(),
            open.clone(),
            opts.clone(),
            cut_rx.clone(),
            shutdown.clone(),
        );
        let tls = opts.tls.as_ref().map(|t| t.acceptor());
        tokio::spawn(async move {
            if let Place::Wait(freed) = place {
                let deadline = activity.opened + opts.header_read_timeout;
                // Its first bytes (not its closing: a peek of nothing).
                let spoke = async {
                    let mut b = [0u8; 1];
                    matches!(stream.peek(&mut b).await, Ok(n) if n > 0)
                };
                if !ticket.wait_for_place(&freed, deadline, spoke).await {
                    tracing::debug!(%peer, "client connection closed: no place for its address in time");
                    return;
                }
            }
            let watch = Watch {
                activity: &activity,
                opts: &opts,
                cut,
                shutdown,
            };
            match tls {
                None => serve_conn(stream, svc, &builders, watch).await,
                Some(acceptor) => {
                    // The handshake counts against the first request's header deadline: a
                    // client that connects and never finishes it holds its slot no longer
                    // than one that never sends headers.
                    let deadline = activity.opened + opts.header_read_timeout;
                    // rustls's connection state is made only once the client has sent
                    // something: a socket that connects and says nothing costs no more over
                    // TLS than in cleartext.
                    let handshake = tokio::select! {
                        r = tokio::time::timeout_at(deadline, async {
                            stream.readable().await?;
                            activity.spoke();
                            acceptor.accept(stream).await
                        }) => r,
                        () = activity.evicted() => {
                            tracing::debug!(%peer, "TLS handshake cut: replaced by a newer connection");
                            return;
                        }
                    };
                    let stream = match handshake {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake not done within header_read_timeout");
                            return;
                        }
                    };
                    serve_conn(stream, svc, &builders, watch).await;
                }
            }
            drop(ticket);
            drop(slot);
            drop(open);
        });
    }
    drop(listener);
    drop(open);
    let drained = all_closed.recv();
    let mut drained = std::pin::pin!(drained);
    if tokio::time::timeout(opts.drain_grace, &mut drained)
        .await
        .is_err()
    {
        tracing::warn!("drain grace expired with connections still open: closing them");
        // Without this the connection tasks, streams included, would outlive the server: in
        // a process that goes on (tests, the demo) they kept streaming after shutdown returned.
        let _ = cut.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(1), &mut drained).await;
    }
}

/// Serves one client connection: HTTP/1 or h2 as its first bytes say (an h2 client's preface
/// must come within `header_read_timeout`, as any first request's headers must).
async fn serve_conn<T, S, B>(mut io: T, svc: Tracked<S>, builders: &Arc<Builders>, w: Watch<'_>)
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: tower::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>
        + Send
        + Unpin
        + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let deadline = w.activity.opened + w.opts.header_read_timeout;
    let (mut cut, mut shutdown) = (w.cut.clone(), w.shutdown.clone());
    // Nothing in flight yet: at shutdown there is nothing to finish.
    let sniffed = tokio::select! {
        r = tokio::time::timeout_at(deadline, conn::sniff(&mut io)) => r,
        _ = cut.wait_for(|c| *c) => return,
        _ = shutdown_signalled(&mut shutdown) => return,
        () = w.activity.evicted() => {
            tracing::debug!("client connection closed before its first bytes: replaced by a newer one");
            return;
        }
    };
    let (first, h2) = match sniffed {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "client connection failed before its first request");
            return;
        }
        Err(_) => {
            tracing::debug!("client connection closed: no request within header_read_timeout");
            return;
        }
    };
    w.activity.spoke();
    let io = conn::client_io(io, first, w.activity.clone(), !h2);
    // Boxed: hyper's connection and its watch are only made here, so the task of a connection
    // still waiting for its first bytes (most of a flood) is no larger than what it holds.
    match h2 {
        true => Box::pin(drive(builders.h2.serve_connection(io, svc), w)).await,
        false => Box::pin(drive(conn::H1::new(builders.clone(), io, svc), w)).await,
    }
}

/// A connection's service, as hyper calls it, keeping the connection's [`Activity`] current.
///
/// hyper calls `call` from the connection's own task, one call at a time, so the tower service
/// (whose `call` wants `&mut self`) sits in a `RefCell` instead of being cloned for every
/// request, as hyper_util's adapter does: a clone of the whole stack per request. The services
/// served here are always ready (admission is decided per request), so `poll_ready` is not asked.
struct Tracked<S> {
    inner: RefCell<S>,
    activity: Arc<Activity>,
}

impl<S, B> hyper::service::Service<Request<Incoming>> for Tracked<S>
where
    S: tower::Service<Request<Incoming>, Response = Response<B>, Error = Infallible>,
{
    type Response = Response<TrackedBody<B>>;
    type Error = Infallible;
    type Future = TrackedFuture<S::Future>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let guard = Some(self.activity.begin());
        let fut = self.inner.borrow_mut().call(req);
        TrackedFuture { fut, guard }
    }
}

pin_project_lite::pin_project! {
    /// The response, once it comes, with the connection's activity mark moved into its body.
    pub struct TrackedFuture<F> {
        #[pin]
        fut: F,
        guard: Option<ActiveGuard>,
    }
}

impl<F, B> Future for TrackedFuture<F>
where
    F: Future<Output = Result<Response<B>, Infallible>>,
{
    type Output = Result<Response<TrackedBody<B>>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let resp = std::task::ready!(this.fut.poll(cx))?;
        let guard = this.guard.take();
        if resp.status() == http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE {
            // Told to the connection's bytes, which must let this 431 through (conn.rs).
            if let Some(g) = &guard {
                g.answered_431();
            }
        }
        Poll::Ready(Ok(resp.map(|body| TrackedBody {
            body,
            _guard: guard,
        })))
    }
}

/// A response body that keeps its request active on the connection until it ends.
pub struct TrackedBody<B> {
    body: B,
    _guard: Option<ActiveGuard>,
}

impl<B: Body + Unpin> Body for TrackedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
