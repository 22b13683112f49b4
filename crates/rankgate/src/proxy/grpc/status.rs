//! A gRPC status as it goes over HTTP/2: the `grpc-status` and `grpc-message` headers (or
//! trailers), percent-encoded as the protocol says, and read back.

use http::header::{HeaderMap, HeaderValue};
use tonic::Code;

/// The content type of every gRPC message.
pub const GRPC: HeaderValue = HeaderValue::from_static("application/grpc");

/// `grpc-status` and `grpc-message` headers (percent-encoded, as the protocol says).
pub fn status_headers(code: Code, message: &str) -> HeaderMap {
    let mut h = HeaderMap::with_capacity(2);
    h.insert("grpc-status", HeaderValue::from(code as i32));
    let mut encoded = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            encoded.push(b as char);
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    if let Ok(v) = HeaderValue::from_str(&encoded) {
        h.insert("grpc-message", v);
    }
    h
}

/// A `grpc-message` as it was before percent-encoding.
pub fn percent_decode(s: &str) -> String {
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
