//! The gRPC answers: rankgate's own (a status alone, or one message), an engine's whole unary
//! answer read back, and the status an engine's answer counts as.

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::{Response, StatusCode};
use tonic::Code;

use super::calls::frame;
use super::status::{percent_decode, status_headers, GRPC};
use crate::proxy::body::ProxyBody;

/// A status with no message: the whole answer in the response headers (trailers-only).
pub fn status_response(code: Code, message: &str) -> Response<ProxyBody> {
    let mut resp = Response::new(ProxyBody::empty());
    let headers = resp.headers_mut();
    headers.insert(header::CONTENT_TYPE, GRPC);
    headers.extend(status_headers(code, message));
    resp
}

/// rankgate's own successful answer: one message, status OK.
pub fn ok_response(message: &[u8]) -> Response<ProxyBody> {
    let mut resp = Response::new(ProxyBody::grpc(
        Some(frame(message)),
        status_headers(Code::Ok, ""),
    ));
    resp.headers_mut().insert(header::CONTENT_TYPE, GRPC);
    resp
}

/// The status an engine's answer counts as for failover and outlier accounting. gRPC answers
/// are all HTTP 200; one that is only a status (trailers-only, so nothing was generated) saying
/// UNAVAILABLE counts as a 503: the engine could not take the call, another rank may.
pub fn answered(resp: &Response<ProxyBody>, grpc: bool) -> StatusCode {
    if !grpc {
        return resp.status();
    }
    match resp.headers().get("grpc-status").map(|v| v.as_bytes()) {
        Some(b"14") => StatusCode::SERVICE_UNAVAILABLE,
        _ => resp.status(),
    }
}

/// Frames and status of an engine's whole unary answer.
pub(super) struct Answer {
    pub(super) headers: HeaderMap,
    pub(super) body: Bytes,
    pub(super) trailers: HeaderMap,
}

impl Answer {
    /// The call's status: in the trailers, or in the headers of a trailers-only answer.
    pub(super) fn status(&self) -> (Code, String) {
        let h = match self.trailers.contains_key("grpc-status") {
            true => &self.trailers,
            false => &self.headers,
        };
        let code = h
            .get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<i32>().ok())
            .map_or(Code::Unknown, Code::from_i32);
        let message = h
            .get("grpc-message")
            .and_then(|v| v.to_str().ok())
            .map(percent_decode)
            .unwrap_or_default();
        (code, message)
    }

    pub(super) fn into_response(self) -> Response<ProxyBody> {
        let mut resp = Response::new(ProxyBody::grpc(Some(self.body), self.trailers));
        *resp.headers_mut() = self.headers;
        resp
    }
}
