//! Request identity, the outermost layer: every request gets an `x-request-id` (the client's
//! when it sent a usable one, a fresh random one otherwise), sent to the engine and returned to
//! the client, on rankgate's own error answers too; the engine learns who asked through
//! `X-Forwarded-For` and `X-Forwarded-Proto`; and the W3C trace context is continued (the
//! client's trace, with rankgate's hop as the parent the engine sees) or started, so an engine
//! that traces (vLLM `--otlp-traces-endpoint`) joins the client's trace.
//!
//! It runs on every request, so it allocates as little as it can: a generated id is 32 hex
//! digits written into a stack buffer, and the connection's own address is rendered once per
//! connection ([`super::Conn::peer_ip`]), so the usual request (no `X-Forwarded-For` of its own)
//! only clones it.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response};

use super::{Ctx, ProxyBody};

pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
pub const FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub const FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// Longest client id kept: longer ones are replaced rather than forwarded into engine logs.
pub const MAX_REQUEST_ID_BYTES: usize = 128;

/// Whether a client's id can be kept: 1 to 128 visible ASCII characters (no spaces or control
/// characters, which would break the log lines and headers it is copied into).
pub fn valid_request_id(v: &[u8]) -> bool {
    !v.is_empty() && v.len() <= MAX_REQUEST_ID_BYTES && v.iter().all(u8::is_ascii_graphic)
}

/// A fresh id: 128 random bits as 32 lowercase hex digits.
pub fn new_request_id() -> HeaderValue {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut n: u128 = rand::random();
    let mut buf = [0u8; 32];
    for b in buf.iter_mut().rev() {
        *b = HEX[(n & 0xf) as usize];
        n >>= 4;
    }
    HeaderValue::from_bytes(&buf).unwrap_or(HeaderValue::from_static("0"))
}

/// The request's id: its own single valid `x-request-id`, or a new one put in its place.
fn request_id(h: &mut HeaderMap) -> HeaderValue {
    let mut sent = h.get_all(&REQUEST_ID).iter();
    if let (Some(v), None) = (sent.next(), sent.next()) {
        if valid_request_id(v.as_bytes()) {
            return v.clone();
        }
    }
    let id = new_request_id();
    h.insert(REQUEST_ID, id.clone());
    id
}

/// Lowercase hex of `n`'s low `N / 2` bytes into `out`.
fn hex_into<const N: usize>(mut n: u128, out: &mut [u8; N]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for b in out.iter_mut().rev() {
        *b = HEX[(n & 0xf) as usize];
        n >>= 4;
    }
}

/// The trace id and flags of a valid `traceparent` (W3C Trace Context level 1): version `00`
/// exactly `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`, ids not all zero, lowercase;
/// a later version may append fields after the four it shares with `00`.
fn parse_traceparent(v: &[u8]) -> Option<([u8; 32], [u8; 2])> {
    let hex = |s: &[u8]| {
        s.iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    };
    let zero = |s: &[u8]| s.iter().all(|b| *b == b'0');
    if v.len() < 55 || !hex(&v[..2]) || &v[..2] == b"ff" || (&v[..2] == b"00" && v.len() != 55) {
        return None;
    }
    if v.len() > 55 && v[55] != b'-' {
        return None;
    }
    let (trace, parent, flags) = (&v[3..35], &v[36..52], &v[53..55]);
    let dashes = v[2] == b'-' && v[35] == b'-' && v[52] == b'-';
    if !dashes || !hex(trace) || !hex(parent) || !hex(flags) || zero(trace) || zero(parent) {
        return None;
    }
    Some((trace.try_into().ok()?, flags.try_into().ok()?))
}

/// Continues the client's trace with rankgate's own hop as the engine's parent, or starts one
/// (sampled, so a tracing engine records it). An invalid `traceparent` is replaced, and its
/// `tracestate` dropped with it, as the spec requires.
fn trace_context(h: &mut HeaderMap) {
    let mut sent = h.get_all(&TRACEPARENT).iter();
    let valid = match (sent.next(), sent.next()) {
        (Some(v), None) => parse_traceparent(v.as_bytes()),
        _ => None,
    };
    let (trace, flags) = match valid {
        Some(t) => t,
        None => {
            h.remove(&TRACESTATE);
            let mut trace = [0u8; 32];
            hex_into(rand::random::<u128>() | 1, &mut trace);
            (trace, *b"01")
        }
    };
    let mut span = [0u8; 16];
    hex_into(u128::from(rand::random::<u64>() | 1), &mut span);
    let mut v = [0u8; 55];
    v[..3].copy_from_slice(b"00-");
    v[3..35].copy_from_slice(&trace);
    v[35] = b'-';
    v[36..52].copy_from_slice(&span);
    v[52] = b'-';
    v[53..].copy_from_slice(&flags);
    if let Ok(v) = HeaderValue::from_bytes(&v) {
        h.insert(TRACEPARENT, v);
    }
}

/// `X-Forwarded-For`: the client's address appended to what earlier proxies wrote (all of the
/// header's lines, in order), or alone when there is nothing.
pub fn forward_for(h: &mut HeaderMap, peer_ip: &HeaderValue) {
    let mut earlier = h.get_all(&FORWARDED_FOR).iter().peekable();
    if earlier.peek().is_none() {
        h.insert(FORWARDED_FOR, peer_ip.clone());
        return;
    }
    let mut joined = Vec::with_capacity(64);
    for v in earlier {
        let v = v.as_bytes().trim_ascii();
        if v.is_empty() {
            continue;
        }
        joined.extend_from_slice(v);
        joined.extend_from_slice(b", ");
    }
    joined.extend_from_slice(peer_ip.as_bytes());
    // Made only of bytes that were valid header values already; should that ever fail, the
    // client's own address is still right.
    let v = HeaderValue::from_bytes(&joined).unwrap_or_else(|_| peer_ip.clone());
    h.insert(FORWARDED_FOR, v);
}

/// The client's address as a header value, rendered once per connection. An IPv4 client of a
/// dual-stack listener shows as its IPv4 address, not `::ffff:a.b.c.d`.
pub fn peer_ip_header(peer: std::net::SocketAddr) -> HeaderValue {
    HeaderValue::from_str(&peer.ip().to_canonical().to_string())
        .unwrap_or(HeaderValue::from_static("unknown"))
}

#[derive(Clone)]
pub struct Identity<S> {
    inner: S,
    ctx: Ctx,
}

impl<S> Identity<S> {
    pub fn new(inner: S, ctx: &Ctx) -> Identity<S> {
        Identity {
            inner,
            ctx: ctx.clone(),
        }
    }
}

impl<S, B> tower::Service<Request<B>> for Identity<S>
where
    S: tower::Service<Request<B>, Response = Response<ProxyBody>, Error = Infallible>,
    S::Future: Unpin,
{
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Identified<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let h = req.headers_mut();
        let id = request_id(h);
        trace_context(h);
        forward_for(h, &self.ctx.conn().peer_ip);
        h.entry(FORWARDED_PROTO)
            .or_insert(HeaderValue::from_static("http"));
        Identified {
            inner: self.inner.call(req),
            id: Some(id),
        }
    }
}

/// The answer below, with the request's id on it.
pub struct Identified<F> {
    inner: F,
    id: Option<HeaderValue>,
}

impl<F> Future for Identified<F>
where
    F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Unpin,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let mut resp = ready!(Pin::new(&mut this.inner).poll(cx))?;
        if let Some(id) = this.id.take() {
            // Replaces any the engine echoed: the client hears the id the engine was sent.
            resp.headers_mut().insert(REQUEST_ID, id);
        }
        Poll::Ready(Ok(resp))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_valid_trace_is_continued_with_a_new_parent_and_an_invalid_one_replaced() {
        let client = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut h = HeaderMap::new();
        h.insert(TRACEPARENT, HeaderValue::from_static(client));
        h.insert(TRACESTATE, HeaderValue::from_static("congo=t61rcWkgMzE"));
        trace_context(&mut h);
        let v = h[&TRACEPARENT].to_str().unwrap().to_string();
        assert_eq!(&v[..36], &client[..36], "same version and trace id");
        assert_ne!(
            &v[36..52],
            &client[36..52],
            "rankgate's own hop is the parent"
        );
        assert_eq!(&v[52..], "-01");
        assert_eq!(h[&TRACESTATE], "congo=t61rcWkgMzE");
        assert!(parse_traceparent(v.as_bytes()).is_some());

        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "garbage",
        ] {
            let mut h = HeaderMap::new();
            h.insert(TRACEPARENT, HeaderValue::from_str(bad).unwrap());
            h.insert(TRACESTATE, HeaderValue::from_static("a=b"));
            trace_context(&mut h);
            let v = h[&TRACEPARENT].to_str().unwrap();
            assert_ne!(
                &v[3..35],
                bad.get(3..35).unwrap_or(""),
                "{bad}: a new trace"
            );
            assert!(parse_traceparent(v.as_bytes()).is_some(), "{bad} -> {v}");
            assert!(
                !h.contains_key(&TRACESTATE),
                "{bad}: its tracestate goes with it"
            );
        }
        // A later version's extra fields are allowed.
        assert!(parse_traceparent(
            b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-later"
        )
        .is_some());
    }

    #[test]
    fn request_ids_kept_only_when_visible_ascii_and_short() {
        assert!(valid_request_id(b"abc-123_XYZ.:/="));
        assert!(valid_request_id(&[b'a'; 128]));
        assert!(!valid_request_id(&[b'a'; 129]));
        assert!(!valid_request_id(b""));
        assert!(!valid_request_id(b"has space"));
        assert!(!valid_request_id(b"tab\there"));
        assert!(!valid_request_id("caf\u{e9}".as_bytes()));
    }

    #[test]
    fn generated_ids_are_32_hex_digits_and_differ() {
        let a = new_request_id();
        let b = new_request_id();
        assert_eq!(a.len(), 32);
        assert!(a.as_bytes().iter().all(u8::is_ascii_hexdigit));
        assert_ne!(a, b);
    }

    #[test]
    fn a_valid_client_id_is_kept_others_replaced() {
        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID, HeaderValue::from_static("client-1"));
        assert_eq!(request_id(&mut h), "client-1");
        assert_eq!(h[REQUEST_ID], "client-1");

        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID, HeaderValue::from_static("has space"));
        let id = request_id(&mut h);
        assert_eq!(id.len(), 32);
        assert_eq!(h[REQUEST_ID], id);

        // Two ids: which one is meant is unknown, so neither is kept.
        let mut h = HeaderMap::new();
        h.append(REQUEST_ID, HeaderValue::from_static("one"));
        h.append(REQUEST_ID, HeaderValue::from_static("two"));
        let id = request_id(&mut h);
        assert_eq!(id.len(), 32);
        assert_eq!(h.get_all(REQUEST_ID).iter().count(), 1);

        let mut h = HeaderMap::new();
        let id = request_id(&mut h);
        assert_eq!(h[REQUEST_ID], id);
    }

    #[test]
    fn forwarded_for_is_set_or_appended() {
        let ip = peer_ip_header(([10, 0, 0, 9], 5000).into());
        let mut h = HeaderMap::new();
        forward_for(&mut h, &ip);
        assert_eq!(h[FORWARDED_FOR], "10.0.0.9");

        let mut h = HeaderMap::new();
        h.insert(FORWARDED_FOR, HeaderValue::from_static("1.1.1.1, 2.2.2.2"));
        forward_for(&mut h, &ip);
        assert_eq!(h[FORWARDED_FOR], "1.1.1.1, 2.2.2.2, 10.0.0.9");

        // Several lines are one list, in order.
        let mut h = HeaderMap::new();
        h.append(FORWARDED_FOR, HeaderValue::from_static("1.1.1.1"));
        h.append(FORWARDED_FOR, HeaderValue::from_static("2.2.2.2 "));
        forward_for(&mut h, &ip);
        assert_eq!(h.get_all(FORWARDED_FOR).iter().count(), 1);
        assert_eq!(h[FORWARDED_FOR], "1.1.1.1, 2.2.2.2, 10.0.0.9");
    }

    #[test]
    fn peer_ip_is_canonical() {
        let mapped: std::net::SocketAddr = "[::ffff:10.1.2.3]:80".parse().unwrap();
        assert_eq!(peer_ip_header(mapped), "10.1.2.3");
        let v6: std::net::SocketAddr = "[2001:db8::1]:80".parse().unwrap();
        assert_eq!(peer_ip_header(v6), "2001:db8::1");
    }
}
