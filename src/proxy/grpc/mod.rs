//! The gRPC front door (`server.grpc_listen`): the engines' own gRPC services, routed rank by
//! rank like HTTP.
//!
//! ```text
//! identity, respond, auth   as for HTTP; errors become gRPC statuses (trailers-only)
//! route                     the method table: Generate, Embed and the engine-info calls go
//!                           down the stack to a picked rank; Abort, FlushCache, GetLoads and
//!                           grpc.health.v1 are answered here (local); the rest UNIMPLEMENTED
//! read, admit, retry, pick  the HTTP layers: the message is read whole and the rank field set
//!                           in it at the protobuf wire level (pbwire), every other byte kept
//! track                     which engine holds each in-flight request id, for Abort
//! observe, send             the HTTP layers, over one h2 connection per engine
//! ```
//!
//! Cancellation needs no code of its own: a client that cancels or goes away resets its stream,
//! hyper drops the response body, and with it the engine's stream, which h2 resets in turn.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use tonic::Code;

use super::{Below, Ctx, ProxyBody, ProxyError, Step};
use crate::catalog::ModelError;
use crate::policy::{self, Avoid};
use crate::worker::Flavor;

mod local;
mod track;

pub use track::{Held, Requests, Track};

pub use crate::proto::{HEALTH_SERVICE, SGLANG_SERVICE, VLLM_SERVICE};

/// Which connections a stack serves: the OpenAI HTTP API or the engines' gRPC services.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Front {
    Http,
    Grpc,
}

/// A gRPC-specific failure, with the status code it becomes.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct GrpcError {
    pub code: Code,
    pub message: String,
    /// The HTTP status of the answer when it is not 200: a request that is no gRPC call gets a
    /// status any HTTP client reads as an error.
    pub http: Option<StatusCode>,
}

impl GrpcError {
    pub fn new(code: Code, message: impl Into<String>) -> GrpcError {
        GrpcError {
            code,
            message: message.into(),
            http: None,
        }
    }

    /// Not a gRPC call at all: answered with HTTP `http` (and the gRPC status too).
    fn not_grpc(http: StatusCode, message: &str) -> GrpcError {
        GrpcError {
            http: Some(http),
            ..GrpcError::new(Code::InvalidArgument, message)
        }
    }
}

/// What the front door does with one method of an engine service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    /// To a picked rank; the request message gets the rank in this field, if any.
    Proxy {
        rank_field: Option<u64>,
    },
    Abort,
    FlushCache,
    GetLoads,
}

/// The method table, per flavor (`None`: not served, UNIMPLEMENTED).
fn call(flavor: Flavor, method: &str) -> Option<Call> {
    let sglang = flavor == Flavor::Sglang;
    Some(match method {
        "Generate" => Call::Proxy {
            rank_field: Some(if sglang { 16 } else { 9 }),
        },
        // vLLM's EmbedRequest has no rank field: the pick still places it and counts it.
        "Embed" => Call::Proxy {
            rank_field: sglang.then_some(8),
        },
        "HealthCheck" | "GetModelInfo" | "GetServerInfo" | "GetTokenizer" => {
            Call::Proxy { rank_field: None }
        }
        "Abort" => Call::Abort,
        "FlushCache" => Call::FlushCache,
        "GetLoads" => Call::GetLoads,
        _ => return None,
    })
}

/// `/service/method` split, with the flavor the service belongs to.
fn parse_path(path: &str) -> Option<(&str, &str)> {
    path.strip_prefix('/')?.split_once('/')
}

fn flavor_of(service: &str) -> Option<Flavor> {
    match service {
        VLLM_SERVICE => Some(Flavor::Vllm),
        SGLANG_SERVICE => Some(Flavor::Sglang),
        _ => None,
    }
}

/// The rank field of a proxied call's request message (for `pick`).
pub fn rank_field(path: &str) -> Option<u64> {
    let (service, method) = parse_path(path)?;
    match call(flavor_of(service)?, method)? {
        Call::Proxy { rank_field } => rank_field,
        _ => None,
    }
}

/// The request id (field 1 of a `GenerateRequest` or `EmbedRequest`) of a proxied call, for
/// `track`; `None` for the calls that carry none.
fn request_id<'a>(path: &str, message: &'a [u8]) -> Option<&'a str> {
    let (_, method) = parse_path(path)?;
    if !matches!(method, "Generate" | "Embed") {
        return None;
    }
    strings(message, 1).ok()?.pop()
}

/// Every string value of length-delimited `field` at the message's top level; `Err` when the
/// message is not protobuf.
fn strings(message: &[u8], field: u64) -> Result<Vec<&str>, GrpcError> {
    let fields = crate::pbwire::fields(message)
        .map_err(|e| GrpcError::new(Code::InvalidArgument, format!("request message: {e}")))?;
    Ok(fields
        .into_iter()
        .filter(|(f, _, _)| *f == field)
        .filter_map(|(_, start, end)| {
            let payload = crate::pbwire::payload(&message[start..end])?;
            std::str::from_utf8(payload).ok()
        })
        .collect())
}

/// A gRPC body holding exactly one message: the message. The front door edits and reads only
/// uncompressed unary requests.
pub fn one_message(body: &[u8]) -> Result<&[u8], GrpcError> {
    let bad = |m: String| GrpcError::new(Code::InvalidArgument, m);
    let head = body.get(..5).ok_or_else(|| {
        bad(format!(
            "gRPC body of {} bytes holds no message",
            body.len()
        ))
    })?;
    if head[0] != 0 {
        return Err(GrpcError::new(
            Code::Unimplemented,
            "compressed request messages are not supported: rankgate sets the rank inside the message (send it uncompressed)",
        ));
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    match body.len() - 5 {
        n if n < len => Err(bad(format!("gRPC message cut short: {n} of {len} bytes"))),
        n if n > len => Err(bad(
            "more than one request message for a unary-request method".into(),
        )),
        _ => Ok(&body[5..]),
    }
}

/// One message in a gRPC frame.
pub fn frame(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(message.len() + 5);
    out.put_u8(0);
    out.put_u32(message.len() as u32);
    out.put_slice(message);
    out.freeze()
}

/// The request body with the rank field of its one message set to `rank`.
pub fn pin(body: &[u8], field: u64, rank: u32) -> Result<Bytes, ProxyError> {
    let message = one_message(body)?;
    let edited = crate::pbwire::set_varint(message, field, u64::from(rank))
        .map_err(|e| GrpcError::new(Code::InvalidArgument, format!("request message: {e}")))?;
    Ok(frame(&edited))
}

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

const GRPC: HeaderValue = HeaderValue::from_static("application/grpc");

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

use super::trace::DebugRefused;

/// The gRPC status an error becomes.
pub fn code_of(err: &ProxyError) -> Code {
    match err.root() {
        ProxyError::Grpc(g) => g.code,
        ProxyError::NotFound(_)
        | ProxyError::NoEngineFor(_)
        | ProxyError::MethodNotAllowed { .. } => Code::Unimplemented,
        ProxyError::Model(ModelError::NotFound { .. }) => Code::NotFound,
        ProxyError::Unauthorized(_) => Code::Unauthenticated,
        ProxyError::Debug(d) => match d {
            DebugRefused::NotOne => Code::InvalidArgument,
            DebugRefused::Off => Code::PermissionDenied,
            DebugRefused::Missing | DebugRefused::Wrong => Code::Unauthenticated,
        },
        ProxyError::OriginNotAllowed(_) => Code::PermissionDenied,
        ProxyError::TooLarge(_) | ProxyError::Overloaded(_) => Code::ResourceExhausted,
        ProxyError::ClientBody(super::ClientBodyError::Stalled(_)) | ProxyError::Timeout(_) => {
            Code::DeadlineExceeded
        }
        ProxyError::BadJson(_)
        | ProxyError::NotObject
        | ProxyError::Refused(_)
        | ProxyError::Scan(_)
        | ProxyError::Model(ModelError::Missing(_))
        | ProxyError::ClientBody(_) => Code::InvalidArgument,
        ProxyError::NoRank(_)
        | ProxyError::NoRankUnlisted { .. }
        | ProxyError::EngineBusy { .. }
        | ProxyError::Upstream { .. }
        | ProxyError::StaleConnection { .. } => Code::Unavailable,
        ProxyError::Internal(_) | ProxyError::At { .. } => Code::Internal,
    }
}

/// The HTTP status a gRPC error would have on the HTTP front door (it never reaches it; this
/// keeps [`ProxyError::status`] total).
pub fn http_status(code: Code) -> StatusCode {
    match code {
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
            StatusCode::BAD_REQUEST
        }
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        _ => StatusCode::BAD_GATEWAY,
    }
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

/// The ranks a gRPC call of `flavor` may go to: those of engines of the flavor with a
/// `grpc_url`; `None` when the fleet has no such engine now.
pub fn targets(ctx: &Ctx, flavor: Flavor) -> Option<Avoid> {
    let front = policy::Front::Grpc(flavor);
    let snap = ctx.table.snapshot.load();
    (snap.fleet.engines.iter())
        .any(|e| front.served_by(e))
        .then(|| Avoid::front(front))
}

/// The method table in front of the rest of the stack.
#[derive(Clone)]
pub struct Route<S> {
    inner: S,
    ctx: Ctx,
}

impl<S> Route<S> {
    pub fn new(inner: S, ctx: &Ctx) -> Route<S> {
        Route {
            inner,
            ctx: ctx.clone(),
        }
    }
}

impl<S> tower::Service<Request<Incoming>> for Route<S>
where
    S: Below<Incoming>,
{
    layer_types!(Step<S::Future>);

    fn call(&mut self, mut req: Request<Incoming>) -> Self::Future {
        let is_grpc = req
            .headers()
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
        // The gRPC protocol (PROTOCOL-HTTP2.md): a request that is not gRPC gets 415, so that no
        // HTTP client reads the gRPC error's 200 as an answer.
        if req.method() != Method::POST || !is_grpc {
            return Step::ready(Err(GrpcError::not_grpc(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "the gRPC listener takes gRPC calls: POST with content-type application/grpc",
            )
            .into()));
        }
        // A call's status comes in trailers, which an HTTP/1.1 answer cannot carry: the client
        // could never read the engine's verdict.
        if req.version() != http::Version::HTTP_2 {
            return Step::ready(Err(GrpcError::not_grpc(
                StatusCode::HTTP_VERSION_NOT_SUPPORTED,
                "gRPC needs HTTP/2 (h2c, prior knowledge)",
            )
            .into()));
        }
        let path = req.uri().path().to_owned();
        let unimplemented =
            |what: String| Step::ready(Err(GrpcError::new(Code::Unimplemented, what).into()));
        let Some((service, method)) = parse_path(&path) else {
            return unimplemented(format!(
                "{path} is not a gRPC method path (/service/method)"
            ));
        };
        if service == HEALTH_SERVICE {
            return Step::Own(Box::pin(local::health(self.ctx.clone(), req)));
        }
        let Some(flavor) = flavor_of(service) else {
            return unimplemented(format!(
                "service {service} is not served: rankgate fronts {VLLM_SERVICE} and {SGLANG_SERVICE}"
            ));
        };
        let Some(avoid) = targets(&self.ctx, flavor) else {
            return unimplemented(format!(
                "service {service}: no {flavor} engine in this fleet has a grpc_url"
            ));
        };
        let ctx = self.ctx.clone();
        match call(flavor, method) {
            None => unimplemented(format!("method {path} is not served by rankgate")),
            Some(Call::Proxy { .. }) => {
                req.extensions_mut().insert(avoid);
                Step::Below(self.inner.call(req))
            }
            Some(Call::GetLoads) => Step::Own(Box::pin(local::get_loads(ctx, flavor, req))),
            Some(Call::Abort) => Step::Own(Box::pin(local::abort(ctx, flavor, req))),
            Some(Call::FlushCache) => Step::Own(Box::pin(local::flush_cache(ctx, flavor, req))),
        }
    }
}

/// Whether the front door is ready for new gRPC calls of `flavor` (`None`: all of them): not
/// shutting down, and a rank to send them to.
fn serving(ctx: &Ctx, flavor: Option<Flavor>) -> bool {
    if ctx.draining.load(Relaxed) {
        return false;
    }
    let all = [Flavor::Vllm, Flavor::Sglang];
    let flavors = match flavor {
        Some(f) => std::slice::from_ref(&all[(f == Flavor::Sglang) as usize]),
        None => &all[..],
    };
    flavors.iter().any(|f| {
        targets(ctx, *f).is_some_and(|avoid| ctx.selector.any_routable(&ctx.table, &avoid))
    })
}

/// Frames and status of an engine's whole unary answer.
struct Answer {
    headers: HeaderMap,
    body: Bytes,
    trailers: HeaderMap,
}

impl Answer {
    /// The call's status: in the trailers, or in the headers of a trailers-only answer.
    fn status(&self) -> (Code, String) {
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

    fn into_response(self) -> Response<ProxyBody> {
        let mut resp = Response::new(ProxyBody::grpc(Some(self.body), self.trailers));
        *resp.headers_mut() = self.headers;
        resp
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

impl Ctx {
    /// The shared request-id map (for `track` and Abort).
    pub fn requests(&self) -> &Arc<Requests> {
        &self.grpc_requests
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_message_takes_exactly_one_uncompressed_frame() {
        let f = frame(b"\x0a\x01x");
        assert_eq!(one_message(&f).unwrap(), b"\x0a\x01x");
        assert_eq!(
            one_message(&f[..6]).unwrap_err().code,
            Code::InvalidArgument
        );
        let two = [&f[..], &f[..]].concat();
        assert_eq!(one_message(&two).unwrap_err().code, Code::InvalidArgument);
        let mut compressed = f.to_vec();
        compressed[0] = 1;
        assert_eq!(
            one_message(&compressed).unwrap_err().code,
            Code::Unimplemented
        );
        assert_eq!(one_message(b"").unwrap_err().code, Code::InvalidArgument);
    }

    #[test]
    fn status_message_round_trips_through_percent_encoding() {
        let h = status_headers(Code::Unavailable, "http://h:1@0: 100% gone\nnow é");
        let m = h.get("grpc-message").unwrap().to_str().unwrap();
        assert!(!m.contains('\n') && m.contains("%25"), "{m}");
        assert_eq!(percent_decode(m), "http://h:1@0: 100% gone\nnow é");
        assert_eq!(h.get("grpc-status").unwrap(), "14");
    }

    #[test]
    fn method_table_per_flavor() {
        assert_eq!(rank_field("/vllm.grpc.engine.VllmEngine/Generate"), Some(9));
        assert_eq!(
            rank_field("/sglang.grpc.scheduler.SglangScheduler/Generate"),
            Some(16)
        );
        assert_eq!(
            rank_field("/sglang.grpc.scheduler.SglangScheduler/Embed"),
            Some(8)
        );
        assert_eq!(rank_field("/vllm.grpc.engine.VllmEngine/Embed"), None);
        assert_eq!(
            rank_field("/vllm.grpc.engine.VllmEngine/StartProfile"),
            None
        );
        assert_eq!(call(Flavor::Vllm, "SubscribeKvEvents"), None);
    }

    #[test]
    fn request_id_is_field_one() {
        // field 1 "ab", field 9 = 1
        let msg = [0x0a, 2, b'a', b'b', 0x48, 1];
        assert_eq!(
            request_id("/vllm.grpc.engine.VllmEngine/Generate", &msg),
            Some("ab")
        );
        assert_eq!(
            request_id("/vllm.grpc.engine.VllmEngine/GetServerInfo", &msg),
            None
        );
    }
}
