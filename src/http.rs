//! HTTP plumbing shared by the front door, the admin listener and the simulated engine: an accept
//! loop serving HTTP/1.1 and h2c with graceful drain, pooled upstream clients, and the
//! OpenAI-shaped error body.

use std::convert::Infallible;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use hyper::body::{Body, Incoming};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// How long open connections may finish their requests after shutdown is asked for.
pub const DRAIN_GRACE: Duration = Duration::from_secs(30);

/// A shutdown signal: `true` once shutdown is asked for.
pub type Shutdown = watch::Receiver<bool>;

/// Resolves when `shutdown` flips to true (or its sender is gone).
pub async fn shutdown_signalled(shutdown: &mut Shutdown) {
    while !*shutdown.borrow_and_update() {
        if shutdown.changed().await.is_err() {
            return;
        }
    }
}

/// Serves `handler` on `listener` (HTTP/1.1 and h2c on the same port) until `shutdown`, then
/// waits up to [`DRAIN_GRACE`] for requests in flight to finish.
pub async fn serve<F, Fut, B>(listener: TcpListener, handler: F, mut shutdown: Shutdown)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).keep_alive(true);
    let graceful = GracefulShutdown::new();
    loop {
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(conn) => conn,
                Err(e) => {
                    // Running out of file descriptors must not end the server; back off briefly.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown_signalled(&mut shutdown) => break,
        };
        let _ = stream.set_nodelay(true);
        let svc = hyper::service::service_fn(handler.clone());
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
        let conn = graceful.watch(conn.into_owned());
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(DRAIN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("drain grace expired with connections still open");
    }
}

/// A pooled, keep-alive HTTP/1.1 client for upstream engines.
pub fn client<B>(connect_timeout: Duration) -> Client<HttpConnector, B>
where
    B: Body + Send + 'static + Unpin,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(1024)
        .pool_timer(TokioTimer::new())
        .build(connector)
}

/// Renders an error with its sources, since hyper's top-level message alone ("client error
/// (Connect)") does not say what went wrong.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

/// The OpenAI error JSON body.
pub fn error_json(status: StatusCode, kind: &str, message: &str) -> Bytes {
    let body = serde_json::json!({
        "error": { "message": message, "type": kind, "param": null, "code": status.as_u16() }
    });
    Bytes::from(body.to_string())
}

/// A response with a whole body of the given content type.
pub fn respond<B: From<Bytes>>(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<B> {
    let mut resp = Response::new(B::from(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

/// An error response in the OpenAI error JSON shape.
pub fn openai_error<B: From<Bytes>>(status: StatusCode, kind: &str, message: &str) -> Response<B> {
    respond(
        status,
        "application/json",
        error_json(status, kind, message),
    )
}

/// A JSON response.
pub fn json_response<B: From<Bytes>>(status: StatusCode, value: &serde_json::Value) -> Response<B> {
    respond(status, "application/json", value.to_string())
}
