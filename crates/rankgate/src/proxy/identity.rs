//! Request identity, the outermost layer: every request gets an `x-request-id` (the client's
//! when it sent a usable one, a fresh random one otherwise), sent to the engine and returned to
//! the client, on rankgate's own error answers too; the engine learns who asked through
//! `X-Forwarded-For` and `X-Forwarded-Proto`. (The trace context is [`super::trace`]'s.)
//!
//! The hop-by-hop headers go first, here, before anything is written: a client's
//! `Connection: X-Forwarded-For, X-Request-Id` then removes only its own copies, never the
//! headers rankgate writes after (see [`strip_hop_by_hop`] for the names no client can remove).
//! A client's own `X-Forwarded-*` (and `Forwarded`) are believed only from a peer in
//! `server.trusted_proxies`, which they are appended to, as nginx's realip module and Envoy's
//! trusted hops do; anyone else's are replaced by what rankgate saw: the peer's address, and
//! `https` behind rankgate's own TLS listener. The other client-IP claims (`X-Real-IP`,
//! `True-Client-IP`, `X-Client-IP`, `CF-Connecting-IP`, `X-Original-Forwarded-For`) are kept
//! from the same trusted peers only.
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

use super::body::ProxyBody;
use super::pin::strip_hop_by_hop;
use super::shared::Ctx;
use crate::config::Cidr;

pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
pub const FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub const FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Longest client id kept: longer ones are replaced rather than forwarded into engine logs.
pub const MAX_REQUEST_ID_BYTES: usize = 128;

/// Whether a client's id can be kept: 1 to 128 visible ASCII characters (no spaces or control
/// characters, which would break the log lines and headers it is copied into).
pub fn valid_request_id(v: &[u8]) -> bool {
    !v.is_empty() && v.len() <= MAX_REQUEST_ID_BYTES && v.iter().all(u8::is_ascii_graphic)
}

/// A fresh id: 128 random bits as 32 lowercase hex digits.
pub fn new_request_id() -> HeaderValue {
    let mut buf = [0u8; 32];
    crate::tracecontext::hex_into(rand::random(), &mut buf);
    crate::tracecontext::shared_value(buf)
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

/// The other headers that claim a client's address, written by CDNs and other proxies
/// (nginx's realip module, Cloudflare, Akamai, ingress-nginx's copy of the original
/// `X-Forwarded-For`). An engine or its logs may believe them, so a stranger's are dropped too.
pub const CLIENT_IP_HEADERS: [&str; 5] = [
    "x-real-ip",
    "true-client-ip",
    "x-client-ip",
    "cf-connecting-ip",
    "x-original-forwarded-for",
];

/// Whether `n` is a forwarding header a client may have written: `X-Forwarded-*`, `Forwarded`,
/// or one of [`CLIENT_IP_HEADERS`].
fn is_forwarding(n: &HeaderName) -> bool {
    let n = n.as_str().as_bytes();
    n.starts_with(b"x-forwarded-")
        || n == b"forwarded"
        // Their lengths (9..=24) first: most names are ruled out by one compare.
        || ((9..=24).contains(&n.len()) && CLIENT_IP_HEADERS.iter().any(|c| c.as_bytes() == n))
}

/// The forwarding headers the engine gets: a trusted proxy's appended to, anyone else's
/// replaced by the peer's address and `proto`.
pub fn forwarded(h: &mut HeaderMap, peer_ip: &HeaderValue, trusted: bool, proto: &HeaderValue) {
    // The usual request carries none: one look at its few names, then two inserts.
    if h.keys().any(is_forwarding) {
        if trusted {
            forward_for(h, peer_ip);
            if !h.contains_key(FORWARDED_PROTO) {
                h.insert(FORWARDED_PROTO, proto.clone());
            }
            return;
        }
        // A stranger's claims (`X-Forwarded-Host`, `-Port`, `Forwarded`, `X-Real-IP` and the
        // other client-IP headers too) are dropped.
        while let Some(n) = h.keys().find(|n| is_forwarding(n)).cloned() {
            h.remove(&n);
        }
    }
    h.insert(FORWARDED_FOR, peer_ip.clone());
    h.insert(FORWARDED_PROTO, proto.clone());
}

/// How forwarding headers are written, one for the router.
#[derive(Debug)]
pub struct Forwarding {
    /// `server.trusted_proxies`.
    pub trusted: Box<[Cidr]>,
    /// `X-Forwarded-Proto` as rankgate saw it: `https` behind its own TLS listener.
    pub proto: HeaderValue,
}

impl Forwarding {
    pub fn new(trusted: &[Cidr], tls: bool) -> Forwarding {
        Forwarding {
            trusted: trusted.into(),
            proto: HeaderValue::from_static(if tls { "https" } else { "http" }),
        }
    }
}

#[derive(Clone)]
pub struct Identity<S> {
    inner: S,
    ctx: Ctx,
    /// The connection's peer is a trusted proxy (decided once per connection).
    trusted: bool,
    proto: HeaderValue,
}

impl<S> Identity<S> {
    pub fn new(inner: S, ctx: &Ctx, forwarding: &Forwarding) -> Identity<S> {
        let peer = ctx.conn().peer.ip();
        Identity {
            inner,
            ctx: ctx.clone(),
            trusted: forwarding.trusted.iter().any(|c| c.contains(peer)),
            proto: forwarding.proto.clone(),
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
        strip_hop_by_hop(h);
        let id = request_id(h);
        forwarded(h, &self.ctx.conn().peer_ip, self.trusted, &self.proto);
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
    use crate::proxy::shared::peer_ip_header;

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
    fn strangers_forwarding_headers_are_replaced_trusted_ones_kept() {
        let ip = peer_ip_header(([10, 0, 0, 9], 5000).into());
        let https = HeaderValue::from_static("https");
        let claims = || {
            let mut h = HeaderMap::new();
            h.insert(FORWARDED_FOR, HeaderValue::from_static("1.1.1.1"));
            h.insert(FORWARDED_PROTO, HeaderValue::from_static("http"));
            h.insert("x-forwarded-host", HeaderValue::from_static("evil.example"));
            h.insert("forwarded", HeaderValue::from_static("for=1.1.1.1"));
            h
        };
        let mut h = claims();
        forwarded(&mut h, &ip, false, &https);
        assert_eq!(h[FORWARDED_FOR], "10.0.0.9");
        assert_eq!(h[FORWARDED_PROTO], "https");
        assert!(!h.contains_key("x-forwarded-host") && !h.contains_key("forwarded"));

        let mut h = claims();
        forwarded(&mut h, &ip, true, &https);
        assert_eq!(h[FORWARDED_FOR], "1.1.1.1, 10.0.0.9");
        assert_eq!(
            h[FORWARDED_PROTO], "http",
            "the proxy saw the client's scheme"
        );
        assert_eq!(h["x-forwarded-host"], "evil.example");

        let mut h = HeaderMap::new();
        forwarded(&mut h, &ip, true, &https);
        assert_eq!((&h[FORWARDED_FOR], &h[FORWARDED_PROTO]), (&ip, &https));
    }

    #[test]
    fn client_ip_claims_are_kept_only_from_trusted_proxies() {
        let ip = peer_ip_header(([10, 0, 0, 9], 5000).into());
        let http = HeaderValue::from_static("http");
        for name in CLIENT_IP_HEADERS {
            let mut h = HeaderMap::new();
            h.insert(name, HeaderValue::from_static("6.6.6.6"));
            h.insert("x-real-ipx", HeaderValue::from_static("kept"));
            forwarded(&mut h, &ip, false, &http);
            assert!(!h.contains_key(name), "{name} from a stranger passed");
            assert_eq!(h["x-real-ipx"], "kept", "only the listed names go");
            assert_eq!(h[FORWARDED_FOR], "10.0.0.9");

            let mut h = HeaderMap::new();
            h.insert(name, HeaderValue::from_static("6.6.6.6"));
            forwarded(&mut h, &ip, true, &http);
            assert_eq!(h[name], "6.6.6.6", "{name} from a trusted proxy");
            assert_eq!(h[FORWARDED_FOR], "10.0.0.9");
        }
    }

    #[test]
    fn peer_ip_is_canonical() {
        let mapped: std::net::SocketAddr = "[::ffff:10.1.2.3]:80".parse().unwrap();
        assert_eq!(peer_ip_header(mapped), "10.1.2.3");
        let v6: std::net::SocketAddr = "[2001:db8::1]:80".parse().unwrap();
        assert_eq!(peer_ip_header(v6), "2001:db8::1");
    }
}
