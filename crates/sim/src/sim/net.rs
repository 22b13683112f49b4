//! The simulated engine's own accept loop. Unlike `rankgate::http::serve` it can die like a process
//! under `kill -9`: the listener closes and every open connection is dropped at once, mid-body or
//! not, so the router meets the failure it would meet in production.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::{Body, Incoming};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use rankgate::http::{shutdown_signalled, Shutdown};
use rankgate::tls::ServerTls;

/// Longest a client's TLS handshake may take.
const HANDSHAKE: Duration = Duration::from_secs(10);

/// How long open connections may finish their requests after a normal shutdown.
const DRAIN_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// Resolves once the engine is killed. A dropped sender means the engine is gone anyway, but
/// that is a shutdown, not a death, so it never resolves then.
pub(crate) async fn killed(kill: &mut watch::Receiver<bool>) {
    if kill.wait_for(|k| *k).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Spawns hyper's own tasks (one per HTTP/2 stream) so that they end when the engine is killed,
/// whether or not the stream notices its connection is gone.
#[derive(Clone)]
struct KillableExec(watch::Receiver<bool>);

impl<F> hyper::rt::Executor<F> for KillableExec
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn execute(&self, fut: F) {
        let mut kill = self.0.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = fut => {}
                _ = killed(&mut kill) => {}
            }
        });
    }
}

/// Counts a server as running for [`super::SimEngine::dead`] until dropped, which also covers a
/// server task that is aborted or panics.
pub(crate) struct Running(watch::Sender<usize>);

impl Running {
    pub(crate) fn new(count: &watch::Sender<usize>) -> Running {
        count.send_modify(|n| *n += 1);
        Running(count.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Serves `handler` (HTTP/1.1 and h2c) until `shutdown`, draining gracefully, or until `kill`,
/// closing the listener and dropping every connection without a word.
/// The client's address, in each request's extensions.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Peer(pub std::net::SocketAddr);

pub(crate) async fn serve<F, Fut, B>(
    listener: TcpListener,
    tls: Option<Arc<ServerTls>>,
    handler: F,
    mut shutdown: Shutdown,
    mut kill: watch::Receiver<bool>,
    running: Running,
) where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut builder = auto::Builder::new(KillableExec(kill.clone()));
    // uvicorn (h11) bounds a request head by its size, not by a count of lines: hyper's default
    // of 100 lines would refuse what a real engine serves.
    builder
        .http1()
        .timer(TokioTimer::new())
        .keep_alive(true)
        .max_headers(1024);
    let builder = Arc::new(builder);
    let graceful = GracefulShutdown::new();
    let mut conns = JoinSet::new();
    let drain = loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    let h = handler.clone();
                    let svc = hyper::service::service_fn(move |mut req: Request<Incoming>| {
                        req.extensions_mut().insert(Peer(peer));
                        h(req)
                    });
                    let (builder, watcher) = (builder.clone(), graceful.watcher());
                    let acceptor = tls.as_ref().map(|t| t.acceptor());
                    conns.spawn(async move {
                        let served = match acceptor {
                            None => {
                                let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
                                watcher.watch(conn.into_owned()).await
                            }
                            Some(acceptor) => {
                                // A client that never finishes its handshake holds nothing long.
                                let shake = tokio::time::timeout(HANDSHAKE, acceptor.accept(stream));
                                let stream = match shake.await {
                                    Ok(Ok(s)) => s,
                                    Ok(Err(e)) => {
                                        tracing::debug!(error = %e, "sim TLS handshake failed");
                                        return;
                                    }
                                    Err(_) => return,
                                };
                                let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
                                watcher.watch(conn.into_owned()).await
                            }
                        };
                        if let Err(e) = served {
                            tracing::debug!(error = %e, "sim connection ended with error");
                        }
                    });
                }
                Err(e) => {
                    // Out of file descriptors is no reason to stop serving; back off briefly.
                    tracing::warn!(error = %e, "sim accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            // Reaps finished connections so the set holds only open ones.
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            _ = shutdown_signalled(&mut shutdown) => break true,
            _ = killed(&mut kill) => break false,
        }
    };
    drop(listener);
    if drain {
        tokio::select! {
            r = tokio::time::timeout(DRAIN_GRACE, graceful.shutdown()) => if r.is_err() {
                tracing::warn!("sim drain grace expired with connections still open");
            },
            // Killed while draining: stop waiting and drop what is left below.
            _ = killed(&mut kill) => {}
        }
    }
    conns.abort_all();
    // Aborted tasks finish at once; waiting for them means every socket is closed by the time
    // the engine counts as dead.
    while conns.join_next().await.is_some() {}
    drop(running);
}
