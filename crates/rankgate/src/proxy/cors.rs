//! CORS, for browser clients, when `server.cors_allow_origins` lists any origin.
//!
//! Sits outside `respond` and `auth`: a browser sends its preflight (`OPTIONS` with
//! `Access-Control-Request-Method`) without credentials, so rankgate answers it itself, before
//! any key is asked for (204 for an allowed origin, 403 naming the origin otherwise). Every other
//! response to an allowed origin, rankgate's own errors included (a 401 the page must be able to
//! read), carries `Access-Control-Allow-Origin` and exposes the request id and worker headers;
//! whatever CORS answer the engine made itself is taken out, so the list here is the only one.
//! Without the setting the layer holds nothing and adds nothing: an `OPTIONS` goes down the stack
//! as any other request.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, StatusCode};

use super::body::ProxyBody;
use super::error::ProxyError;
use std::sync::Arc;

use super::respond::Errors;
use super::shared::Ctx;

const EXPOSE: HeaderValue = HeaderValue::from_static("x-request-id, x-rankgate-worker");
const ALLOW_METHODS: HeaderValue = HeaderValue::from_static("GET, POST, OPTIONS");
/// What a preflight is allowed when it does not list the headers it wants.
const DEFAULT_ALLOW_HEADERS: HeaderValue =
    HeaderValue::from_static("authorization, content-type, x-request-id");
/// Seconds a browser may cache a preflight's answer.
const MAX_AGE: HeaderValue = HeaderValue::from_static("600");
/// Longest origin quoted back in a refusal.
const MAX_QUOTED_ORIGIN: usize = 200;

/// Which origins may call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allowed {
    /// `*` is configured: any origin, answered with `*`.
    Any,
    /// This origin is listed: answered with itself (and `Vary: Origin`).
    Origin,
    No,
}

/// Matches an `Origin` value against the configured origins: exactly, byte for byte (browsers
/// send the serialized origin, `scheme://host[:port]`, so no normalizing is needed), or any
/// origin when `*` is among them.
pub fn allowed(origins: &[String], origin: &[u8]) -> Allowed {
    if origins.iter().any(|o| o == "*") {
        Allowed::Any
    } else if origins.iter().any(|o| o.as_bytes() == origin) {
        Allowed::Origin
    } else {
        Allowed::No
    }
}

#[derive(Clone)]
pub struct Cors<S> {
    inner: S,
    /// Only when origins are configured.
    on: Option<On>,
}

#[derive(Clone)]
struct On {
    /// `server.cors_allow_origins`.
    origins: Arc<[String]>,
    /// How a refused preflight is answered (and counted).
    ctx: Ctx,
    errors: Arc<Errors>,
}

impl<S> Cors<S> {
    pub fn new(
        inner: S,
        ctx: &Ctx,
        origins: &Option<Arc<[String]>>,
        errors: &Arc<Errors>,
    ) -> Cors<S> {
        Cors {
            inner,
            on: origins.as_ref().map(|origins| On {
                origins: origins.clone(),
                ctx: ctx.clone(),
                errors: errors.clone(),
            }),
        }
    }
}

/// Takes out the CORS answer an engine made of its own: vLLM's server allows `*` by default,
/// which would let every origin past the configured list.
fn strip_engine_cors(h: &mut HeaderMap) {
    h.remove(header::ACCESS_CONTROL_ALLOW_ORIGIN);
    h.remove(header::ACCESS_CONTROL_ALLOW_CREDENTIALS);
    h.remove(header::ACCESS_CONTROL_EXPOSE_HEADERS);
}

/// The CORS headers of a response to an allowed `origin`.
fn decorate(h: &mut HeaderMap, allowed: Allowed, origin: &HeaderValue) {
    match allowed {
        Allowed::Any => {
            h.insert(
                header::ACCESS_CONTROL_ALLOW_ORIGIN,
                HeaderValue::from_static("*"),
            );
        }
        Allowed::Origin => {
            h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
        }
        Allowed::No => {}
    }
    if allowed != Allowed::No {
        h.insert(header::ACCESS_CONTROL_EXPOSE_HEADERS, EXPOSE);
    }
}

/// The answer to an allowed preflight.
fn preflight(allowed: Allowed, origin: &HeaderValue, req: &HeaderMap) -> Response<ProxyBody> {
    let mut resp = Response::new(ProxyBody::from(bytes::Bytes::new()));
    *resp.status_mut() = StatusCode::NO_CONTENT;
    let h = resp.headers_mut();
    decorate(h, allowed, origin);
    h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, ALLOW_METHODS);
    // Echoing what the browser asks for lets SDKs add their own headers; rankgate does not
    // care which headers come, only the engine might.
    let asked = req.get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned();
    h.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        asked.unwrap_or(DEFAULT_ALLOW_HEADERS),
    );
    h.insert(header::ACCESS_CONTROL_MAX_AGE, MAX_AGE);
    resp
}

fn quoted(origin: &HeaderValue) -> String {
    let text = String::from_utf8_lossy(origin.as_bytes());
    text.chars().take(MAX_QUOTED_ORIGIN).collect()
}

impl<S, B> tower::Service<Request<B>> for Cors<S>
where
    S: tower::Service<Request<B>, Response = Response<ProxyBody>, Error = Infallible>,
    S::Future: Unpin,
{
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Corsed<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let Some(on) = &self.on else {
            return Corsed::Pass(self.inner.call(req));
        };
        let origins = &on.origins;
        // Any origin-dependent answer varies by Origin, also the ones that carry no CORS
        // header: a cache must not hand one origin's answer to another.
        let vary = !origins.iter().any(|o| o == "*");
        let Some(origin) = req.headers().get(header::ORIGIN).cloned() else {
            return Corsed::Decorate {
                inner: self.inner.call(req),
                allowed: Allowed::No,
                origin: None,
                vary,
            };
        };
        let allowed = allowed(origins, origin.as_bytes());
        let is_preflight = req.method() == Method::OPTIONS
            && req
                .headers()
                .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
        if is_preflight {
            let mut resp = if allowed == Allowed::No {
                let err = ProxyError::OriginNotAllowed(quoted(&origin));
                super::respond::error_response(&on.ctx, &on.errors, &err)
            } else {
                preflight(allowed, &origin, req.headers())
            };
            if vary {
                resp.headers_mut()
                    .append(header::VARY, HeaderValue::from_static("origin"));
            }
            return Corsed::Ready(Some(Box::new(resp)));
        }
        Corsed::Decorate {
            inner: self.inner.call(req),
            allowed,
            origin: Some(origin),
            vary,
        }
    }
}

/// The answer below, with the CORS headers it needs; or a preflight's, already made.
pub enum Corsed<F> {
    Pass(F),
    Decorate {
        inner: F,
        allowed: Allowed,
        origin: Option<HeaderValue>,
        vary: bool,
    },
    /// Boxed: preflights are rare (a browser caches the answer), and unboxed a whole response
    /// would make every request's future this large.
    Ready(Option<Box<Response<ProxyBody>>>),
}

impl<F> Future for Corsed<F>
where
    F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Unpin,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            Corsed::Pass(f) => Pin::new(f).poll(cx),
            Corsed::Decorate {
                inner,
                allowed,
                origin,
                vary,
            } => {
                let mut resp = ready!(Pin::new(inner).poll(cx))?;
                let h = resp.headers_mut();
                strip_engine_cors(h);
                if let Some(o) = origin.take() {
                    decorate(h, *allowed, &o);
                }
                if *vary {
                    h.append(header::VARY, HeaderValue::from_static("origin"));
                }
                Poll::Ready(Ok(resp))
            }
            Corsed::Ready(resp) => match resp.take() {
                Some(r) => Poll::Ready(Ok(*r)),
                // Polled again after it was done: a caller's bug, answered without a panic.
                None => Poll::Ready(Ok(crate::http::openai_error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalServerError",
                    "response already taken",
                ))),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn origins_match_exactly_or_by_star() {
        let o = list(&["https://app.example.com", "http://localhost:3000"]);
        assert_eq!(allowed(&o, b"https://app.example.com"), Allowed::Origin);
        assert_eq!(allowed(&o, b"http://localhost:3000"), Allowed::Origin);
        assert_eq!(allowed(&o, b"https://app.example.com:443"), Allowed::No);
        assert_eq!(allowed(&o, b"https://APP.example.com"), Allowed::No);
        assert_eq!(allowed(&o, b"http://localhost:3001"), Allowed::No);
        assert_eq!(allowed(&o, b"null"), Allowed::No);
        assert_eq!(allowed(&list(&["*"]), b"https://x.test"), Allowed::Any);
        assert_eq!(
            allowed(&list(&["https://a.test", "*"]), b"https://x.test"),
            Allowed::Any
        );
        assert_eq!(allowed(&[], b"https://x.test"), Allowed::No);
    }

    #[test]
    fn preflight_echoes_requested_headers_or_a_default() {
        let origin = HeaderValue::from_static("https://a.test");
        let mut req = HeaderMap::new();
        let resp = preflight(Allowed::Origin, &origin, &req);
        assert_eq!(resp.status(), StatusCode::NO_CONTENT);
        let h = resp.headers();
        assert_eq!(h[header::ACCESS_CONTROL_ALLOW_ORIGIN], "https://a.test");
        assert_eq!(
            h[header::ACCESS_CONTROL_ALLOW_METHODS],
            "GET, POST, OPTIONS"
        );
        assert!(h[header::ACCESS_CONTROL_ALLOW_HEADERS]
            .to_str()
            .unwrap()
            .contains("authorization"));
        assert_eq!(h[header::ACCESS_CONTROL_MAX_AGE], "600");

        req.insert(
            header::ACCESS_CONTROL_REQUEST_HEADERS,
            HeaderValue::from_static("x-stainless-os, authorization"),
        );
        let resp = preflight(Allowed::Any, &origin, &req);
        let h = resp.headers();
        assert_eq!(h[header::ACCESS_CONTROL_ALLOW_ORIGIN], "*");
        assert_eq!(
            h[header::ACCESS_CONTROL_ALLOW_HEADERS],
            "x-stainless-os, authorization"
        );
    }

    #[test]
    fn refusals_quote_a_bounded_origin() {
        let long = "x".repeat(1000);
        let q = quoted(&HeaderValue::from_str(&long).unwrap());
        assert_eq!(q.len(), MAX_QUOTED_ORIGIN);
    }
}
