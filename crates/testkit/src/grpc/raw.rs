//! gRPC calls a generated client cannot make: a message framed by hand ([`frame`]) sent on a bare
//! HTTP/2 request ([`raw_call`]), and the whole reply read back ([`RawReply`]: status, headers,
//! messages and trailers) whatever it holds.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, Request, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use tonic::Code;

use super::bounded;

/// One message in a gRPC frame (uncompressed).
pub fn frame(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(message.len() + 5);
    out.put_u8(0);
    out.put_u32(message.len() as u32);
    out.put_slice(message);
    out.freeze()
}

/// A whole gRPC answer as read off the wire by [`raw_call`].
#[derive(Debug)]
pub struct RawReply {
    pub http: StatusCode,
    pub headers: HeaderMap,
    /// The response messages, unframed.
    pub messages: Vec<Bytes>,
    /// `grpc-status` (from the trailers, or the headers of a trailers-only answer).
    pub code: Code,
    /// `grpc-message`, percent-decoded.
    pub message: String,
}

impl RawReply {
    pub fn worker(&self) -> Option<&str> {
        self.headers
            .get("x-rankgate-worker")
            .and_then(|v| v.to_str().ok())
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (b[i], hex) {
            (b'%', Some(v)) => {
                out.push(v);
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One unary-request gRPC call as raw h2c: `message` (any bytes) framed and POSTed to `path`
/// with the gRPC headers; the whole answer (every message, status) read within the timeout.
pub async fn raw_call(addr: SocketAddr, path: &str, message: &[u8]) -> RawReply {
    raw_call_with(addr, path, message, &[]).await
}

/// [`raw_call`] with extra request metadata.
pub async fn raw_call_with(
    addr: SocketAddr,
    path: &str,
    message: &[u8],
    metadata: &[(&str, &str)],
) -> RawReply {
    let mut req = grpc_request(addr, path);
    for (k, v) in metadata {
        req = req.header(*k, *v);
    }
    raw_request(req.body(Full::new(frame(message))).unwrap()).await
}

/// A gRPC call's request head as a client sends it over h2c: POST to `path` with the gRPC
/// content-type and `te: trailers`.
pub fn grpc_request(addr: SocketAddr, path: &str) -> http::request::Builder {
    Request::post(format!("http://{addr}{path}"))
        .version(Version::HTTP_2)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
}

/// Sends `req` over h2c, whatever its body (bytes that are no gRPC frame included), and reads
/// the whole answer within the timeout.
pub async fn raw_request<B>(req: Request<B>) -> RawReply
where
    B: http_body::Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let client = rankgate::http::h2_client::<B>(Duration::from_secs(2));
    let resp = bounded(client.request(req)).await.expect("h2 request");
    read_reply(resp).await
}

/// The whole answer to a raw request (HTTP/2 or HTTP/1.1): messages and gRPC status.
pub async fn read_reply(resp: http::Response<hyper::body::Incoming>) -> RawReply {
    let (parts, body) = resp.into_parts();
    let all = bounded(body.collect()).await.expect("response body");
    let trailers = all.trailers().cloned().unwrap_or_default();
    let mut body = all.to_bytes();
    let mut messages = Vec::new();
    while body.has_remaining() {
        assert!(body.len() >= 5, "a cut frame header: {body:?}");
        assert_eq!(body.get_u8(), 0, "a compressed response message");
        let len = body.get_u32() as usize;
        assert!(body.len() >= len, "a cut message");
        messages.push(body.split_to(len));
    }
    let status = match trailers.contains_key("grpc-status") {
        true => &trailers,
        false => &parts.headers,
    };
    let code = status
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
        .map_or(Code::Unknown, Code::from_i32);
    let message = status
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .map(percent_decode)
        .unwrap_or_default();
    RawReply {
        http: parts.status,
        headers: parts.headers,
        messages,
        code,
        message,
    }
}
