//! The engines' gRPC services as the front door serves them: which methods go to a picked rank
//! (and in which field of their message the rank goes), which are answered here, and the
//! unary request message itself: unframed, read, re-framed with its rank set.

use bytes::{BufMut, Bytes, BytesMut};
use tonic::Code;

use crate::proxy::error::{GrpcError, ProxyError};
use crate::worker::Flavor;

pub use crate::proto::{HEALTH_SERVICE, SGLANG_SERVICE, VLLM_SERVICE};

/// What the front door does with one method of an engine service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Call {
    /// To a picked rank; the request message gets the rank in this field, if any.
    Proxy {
        rank_field: Option<u64>,
    },
    Abort,
    FlushCache,
    GetLoads,
}

/// The method table, per flavor (`None`: not served, UNIMPLEMENTED).
pub(super) fn call(flavor: Flavor, method: &str) -> Option<Call> {
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
pub(super) fn parse_path(path: &str) -> Option<(&str, &str)> {
    path.strip_prefix('/')?.split_once('/')
}

pub(super) fn flavor_of(service: &str) -> Option<Flavor> {
    match service {
        VLLM_SERVICE => Some(Flavor::Vllm),
        SGLANG_SERVICE => Some(Flavor::Sglang),
        _ => None,
    }
}

/// Whether the call at `path` goes to an engine (for `respond`'s count of a client's streams):
/// not the ones answered here, nor those refused.
pub fn proxied(path: &str) -> bool {
    let call = parse_path(path).and_then(|(service, method)| call(flavor_of(service)?, method));
    matches!(call, Some(Call::Proxy { .. }))
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
pub(super) fn request_id<'a>(path: &str, message: &'a [u8]) -> Option<&'a str> {
    let (_, method) = parse_path(path)?;
    if !matches!(method, "Generate" | "Embed") {
        return None;
    }
    strings(message, 1).ok()?.pop()
}

/// Every string value of length-delimited `field` at the message's top level; `Err` when the
/// message is not protobuf.
pub(super) fn strings(message: &[u8], field: u64) -> Result<Vec<&str>, GrpcError> {
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
