//! HTTP plumbing shared by the front door, the admin listener and the simulated engine: the
//! accept loop ([`serve`]: HTTP/1.1 and h2, cleartext or TLS, bounded client connections,
//! graceful drain), pooled clients for `http://` and `https://` upstreams, and the
//! OpenAI-shaped error body.

mod activity;
mod admission;
mod client_key;
mod conn;
mod cut;
mod dial;
mod limits;
mod listen;
mod progress;
mod serve;
mod shutdown;
mod throttle;
mod watch;

pub use conn::MAX_HEADER_LINES;
pub use cut::send_timed_out;
pub use dial::{ConnectTimeout, Dialed, Dialer};
pub use limits::{default_per_client, Door, DoorStats, ServeOptions, ADMIN_CLIENT_SHARE};
pub use listen::{listen, Share};
pub use serve::{serve, serve_with};
pub use shutdown::{shutdown_signalled, Shutdown};
pub use throttle::Throttle;

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use hyper::body::Body;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::tls::Upstream;

/// What rankgate's clients connect with: TCP, and TLS for `https://` URIs, established within
/// the connect timeout ([`dial`]).
pub type Connector = Dialer;

/// A client of rankgate's: engines, the admin listener, the tools.
pub type HttpClient<B> = Client<Connector, B>;

pub(crate) fn connector(connect_timeout: Duration, tls: &Upstream, h2: bool) -> Connector {
    let mut tcp = HttpConnector::new();
    tcp.set_nodelay(true);
    tcp.set_connect_timeout(Some(connect_timeout));
    // The TLS layer above takes https:// URIs too.
    tcp.enforce_http(false);
    let mut builder = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config((*tls.config).clone())
        .https_or_http();
    if let Some(name) = &tls.server_name {
        builder = builder
            .with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name.clone()));
    }
    // ALPN offers what the client will speak.
    let tls = match h2 {
        true => builder.enable_http2().wrap_connector(tcp),
        false => builder.enable_http1().wrap_connector(tcp),
    };
    Dialer::new(tls, connect_timeout, h2)
}

/// [`client_with`] trusting the system's roots.
pub fn client<B>(connect_timeout: Duration) -> HttpClient<B>
where
    B: Body + Send + 'static + Unpin,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    client_with(connect_timeout, Upstream::system())
}

/// A pooled, keep-alive HTTP/1.1 client for upstream engines (`http://` and `https://`).
pub fn client_with<B>(connect_timeout: Duration, tls: &Upstream) -> HttpClient<B>
where
    B: Body + Send + 'static + Unpin,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    Client::builder(TokioExecutor::new())
        // Idle engine connections go after 15 s: each holds its buffers, and after a burst of
        // thousands of streams they were most of the memory kept (vLLM's and SGLang's servers
        // close idle keep-alive connections after 5 s anyway).
        .pool_idle_timeout(Duration::from_secs(15))
        .pool_max_idle_per_host(1024)
        .pool_timer(TokioTimer::new())
        .build(connector(connect_timeout, tls, false))
}

/// [`h2_client_with`] trusting the system's roots.
pub fn h2_client<B>(connect_timeout: Duration) -> HttpClient<B>
where
    B: Body + Send + 'static + Unpin,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    h2_client_with(connect_timeout, Upstream::system())
}

/// An h2 client: prior knowledge over cleartext (gRPC never upgrades from HTTP/1), ALPN `h2`
/// over TLS; one connection per authority, every call a stream on it.
pub fn h2_client_with<B>(connect_timeout: Duration, tls: &Upstream) -> HttpClient<B>
where
    B: Body + Send + 'static + Unpin,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    h2_client_over(connector(connect_timeout, tls, true))
}

/// [`h2_client_with`] over any connector (the proxy's, whose connections a shutdown can cut).
pub fn h2_client_over<C, B>(connector: C) -> Client<C, B>
where
    C: hyper_util::client::legacy::connect::Connect + Clone,
    B: Body + Send + 'static + Unpin,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .http2_max_header_list_size(crate::upstream::MAX_ENGINE_HEADER_BYTES as u32)
        .timer(TokioTimer::new())
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
    // The two ways a wrong scheme shows, which name neither TLS nor the URL.
    if out.contains("InvalidContentType") {
        out.push_str(
            " (TLS to a server that answered in plain text: is its URL https:// by mistake?)",
        );
    } else if out.contains("invalid HTTP version parsed") {
        out.push_str(" (plain HTTP to a server that may speak TLS: should its URL be https://?)");
    }
    if let Some(advice) = crate::tls::advice(&out) {
        out.push_str(&format!(" ({advice})"));
    }
    out
}

/// The OpenAI error JSON body.
pub fn error_json(status: StatusCode, kind: &str, message: &str) -> Bytes {
    error_json_with(kind, message, None, status.as_u16().into())
}

/// The OpenAI error JSON with its `param` and `code`.
pub fn error_json_with(
    kind: &str,
    message: &str,
    param: Option<&str>,
    code: serde_json::Value,
) -> Bytes {
    let body = serde_json::json!({
        "error": { "message": message, "type": kind, "param": param, "code": code }
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
