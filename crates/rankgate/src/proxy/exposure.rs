//! What a client learns about the fleet, decided here and nowhere else (`server.expose_worker`):
//! the `x-rankgate-worker` header on answers and gRPC metadata, and the text of every error
//! answer rankgate makes itself (JSON bodies, gRPC statuses, the error event or trailers of a
//! cut stream).
//!
//! By default a client learns nothing: no header, and messages that name no engine address,
//! no internal URL and no setting (`server.response_timeout` tells an attacker which knob it is
//! pushing on). `name` adds the engine's configured name with the rank; `url` gives the whole
//! detail, addresses included, as the errors' own `Display` writes it. The engines' own response
//! headers that name them ([`ENGINE_NAMING`]: `Server`, `Via`, `Alt-Svc`, `Set-Cookie`, rank
//! headers) are dropped unless `url`. Operators keep that
//! detail whatever the setting: the access log and error log, `x-rankgate-debug` (admin token)
//! and `/workers` on the admin listener read the errors and workers directly, not through here.

use std::fmt::Write;

use http::header::{self, HeaderMap, HeaderName};
use http::HeaderValue;

use super::error::{DebugRefused, DecodeWhy, ProxyError, StreamError};
use crate::config::ExposeWorker;
use crate::policy::NoRank;
use crate::upstream::ClientBodyError;
use crate::worker::Member;

/// How many [`ENGINE_NAMING`] holds.
pub const ENGINE_NAMING_COUNT: usize = 10;

/// The engine response headers that can name an engine, its host or its rank, dropped from
/// every answer unless `expose_worker = "url"` (the only mode that names addresses): `Server`
/// (vLLM's uvicorn says `uvicorn`, a build or a balancer in front may add a host), `Via` (a proxy
/// in front of the engine names its host), `Alt-Svc` (names another host:port of the engine),
/// `Set-Cookie` (an engine itself sets none; a balancer in front of it sets sticky cookies that
/// name the backend, and rankgate keeps no client sessions on an engine), `X-Powered-By`,
/// `X-Served-By` and `X-Backend-Server` (what balancers name their backend with), the rank an
/// engine says it served on (`x-data-parallel-rank`, the simulated engine's `x-sim-rank`), and
/// an upstream gateway's own `x-rankgate-worker` (rankgate's own is written after, by mode).
/// A `static`: a `const` would build the names anew at each use.
pub static ENGINE_NAMING: [HeaderName; ENGINE_NAMING_COUNT] = [
    header::SERVER,
    header::VIA,
    header::ALT_SVC,
    header::SET_COOKIE,
    HeaderName::from_static("x-powered-by"),
    HeaderName::from_static("x-served-by"),
    HeaderName::from_static("x-backend-server"),
    HeaderName::from_static("x-data-parallel-rank"),
    HeaderName::from_static("x-sim-rank"),
    HeaderName::from_static("x-rankgate-worker"),
];

/// One router's answer to "what does a client learn about our fleet". `Copy`: the layers that
/// answer carry it by value. The default tells nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Exposure(ExposeWorker);

impl Exposure {
    pub fn new(mode: ExposeWorker) -> Exposure {
        Exposure(mode)
    }

    /// The `x-rankgate-worker` value (and gRPC metadata) for an answer from `m`; `None`: the
    /// header is not sent.
    pub fn worker(self, m: &Member) -> Option<&HeaderValue> {
        match self.0 {
            ExposeWorker::None => None,
            ExposeWorker::Name => m.named.as_ref(),
            ExposeWorker::Url => Some(&m.header),
        }
    }

    /// An engine's answer headers as clients may see them: without [`ENGINE_NAMING`] unless
    /// `url`. On every answer, so it looks before it touches: one pass over the few names an
    /// engine sends (vLLM: five), then one removal per name found (vLLM: its `server`).
    pub fn scrub(self, h: &mut HeaderMap) {
        if self.0 == ExposeWorker::Url {
            return;
        }
        // The usual answer holds one (an engine's `Server`) or none: one pass finds it, and only
        // an answer with more looks again (no list to fill and drop on every answer).
        let (mut first, mut more) = (None, false);
        for n in h.keys().filter(|n| ENGINE_NAMING.contains(n)) {
            match first {
                None => first = Some(n.clone()),
                Some(_) => {
                    more = true;
                    break;
                }
            }
        }
        let Some(first) = first else { return };
        h.remove(&first);
        while let Some(n) = more
            .then(|| h.keys().find(|n| ENGINE_NAMING.contains(n)).cloned())
            .flatten()
        {
            h.remove(&n);
        }
    }

    /// The message of rankgate's own answer to `err`.
    pub fn error(self, err: &ProxyError) -> String {
        let mut out = String::with_capacity(96);
        self.prefix(&mut out, err.worker().map(|w| &**w));
        // Writing into a String cannot fail.
        let _ = match self.0 {
            ExposeWorker::Url => write!(out, "{err}"),
            _ => write_public(&mut out, err.root()),
        };
        out
    }

    /// The message of a stream cut after its first byte, on `worker`.
    pub fn stream(self, worker: Option<&Member>, err: &StreamError) -> String {
        let mut out = String::with_capacity(64);
        self.prefix(&mut out, worker);
        let _ = match (self.0, err) {
            (ExposeWorker::Url, err) => write!(out, "{err}"),
            (_, StreamError::Broken(_)) => out.write_str("the engine's stream broke"),
            (_, StreamError::Idle(d)) => {
                write!(out, "the engine sent nothing for {} ms", d.as_millis())
            }
            (_, err @ StreamError::ShuttingDown) => write!(out, "{err}"),
        };
        out
    }

    /// `<worker>: ` as far as clients may know the worker.
    fn prefix(self, out: &mut String, worker: Option<&Member>) {
        let shown = worker.and_then(|w| self.worker(w));
        if let Some(text) = shown.and_then(|v| v.to_str().ok()) {
            out.push_str(text);
            out.push_str(": ");
        }
    }
}

/// What a client may read of `err` under `none` and `name`: what went wrong and what it can do,
/// without addresses, internal URLs, engine replies or setting names. The client's own input
/// (its path, origin, model) may be echoed: it is no news to the client.
fn write_public(out: &mut String, err: &ProxyError) -> std::fmt::Result {
    match err {
        ProxyError::NotFound(path) => write!(out, "unknown path {path}"),
        ProxyError::Debug(DebugRefused::Off) => out.write_str("x-rankgate-debug is off"),
        ProxyError::OriginNotAllowed(origin) => write!(out, "origin {origin:?} is not allowed"),
        ProxyError::TooLarge(n) => write!(out, "request body exceeds {n} bytes"),
        ProxyError::ClientBody(ClientBodyError::Stalled(d)) => write!(
            out,
            "request body stalled: no data for {} ms",
            d.as_millis()
        ),
        ProxyError::Overloaded(_) => out.write_str("too many requests in flight; retry later"),
        ProxyError::ClientStreams(_) => {
            out.write_str("too many requests in flight from this address; retry later")
        }
        ProxyError::NoRank(why) | ProxyError::NoRankUnlisted { why, .. } => {
            write!(out, "no routable rank: {}", no_rank(*why))
        }
        ProxyError::Flow(f) => out.write_str(f.public()),
        ProxyError::Upstream { .. } => out.write_str("the engine failed before answering"),
        ProxyError::StaleConnection { .. } => {
            out.write_str("the engine closed its connection before answering")
        }
        ProxyError::Timeout(d) => write!(
            out,
            "the engine sent no response headers within {} ms",
            d.as_millis()
        ),
        ProxyError::EngineBusy { waited, .. } => write!(
            out,
            "every connection to the engine stayed busy for {} ms; retry later",
            waited.as_millis()
        ),
        ProxyError::Internal(_) => out.write_str("internal error"),
        // The adapter is the client's own word; the server and the engine's reply are not.
        ProxyError::Adapter(a) => a.write_public(out),
        ProxyError::PrefillNoParams => {
            out.write_str("the prefill server answered without KV transfer parameters")
        }
        ProxyError::PrefillAnswer(_) => {
            out.write_str("the prefill server's answer could not be read")
        }
        // `why` names a member and the rule it broke, never its value.
        ProxyError::PrefillBadParams { why, .. } => write!(
            out,
            "the prefill server's KV transfer parameters were refused: {why}"
        ),
        // The decode's status, never its reply (an engine's text may name its host).
        ProxyError::Decode(d) => match &d.why {
            DecodeWhy::Answered { status, .. } => write!(out, "decode rank failed: {status}"),
            DecodeWhy::Failed(e) => {
                out.write_str("decode leg failed: ")?;
                write_public(out, e.root())
            }
        },
        // Never an engine or a setting: those go in its `engine` (shown under `url` only).
        ProxyError::Grpc(g) => out.write_str(&g.message),
        // The client's own mistakes, said in the client's terms (no address or setting in
        // them): the path and method, a refused key, a broken or non-JSON body, a model the
        // fleet does not serve (whose list of served models is public at /v1/models anyway).
        e @ (ProxyError::NoEngineFor(_)
        | ProxyError::NotDisaggregable(_)
        | ProxyError::Refused(_)
        | ProxyError::Model(_)
        | ProxyError::Scan(_)
        | ProxyError::MethodNotAllowed { .. }
        | ProxyError::Unauthorized(_)
        | ProxyError::Debug(_)
        | ProxyError::BadJson(_)
        | ProxyError::NotObject
        | ProxyError::ClientBody(_)
        | ProxyError::At { .. }) => write!(out, "{e}"),
    }
}

/// Why no rank was picked, without the setting that decided it.
fn no_rank(why: NoRank) -> &'static str {
    match why {
        NoRank::NoTelemetry => "no rank has fresh load telemetry",
        NoRank::NoneReachable => "no rank is reachable now; retry later",
        NoRank::NoEngine => "no engine serves this",
        NoRank::ShapeUnknown => "no engine that could serve this is ready yet",
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::worker::{test_engine, EngineEntry, Origin};

    fn member(name: Option<&str>) -> Arc<Member> {
        let mut cfg = test_engine("http://10.9.8.7:8000", 2, 0);
        cfg.name = name.map(Into::into);
        let entry = EngineEntry::new(cfg, Origin::Config, Default::default(), None);
        entry.members[1].clone()
    }

    /// Every error kind rankgate answers with, on a worker where one can be.
    fn errors(w: &Arc<Member>) -> Vec<ProxyError> {
        let ms = Duration::from_millis(2000);
        let upstream = ProxyError::Upstream {
            engine: "http://10.9.8.7:8000".into(),
            reason: "connect: tcp connect error: 10.9.8.7:8000 refused".into(),
        };
        vec![
            ProxyError::NotFound("/x".into()),
            ProxyError::Debug(DebugRefused::Off),
            ProxyError::OriginNotAllowed("https://a.example".into()),
            ProxyError::TooLarge(10),
            ProxyError::ClientBody(ClientBodyError::Stalled(ms)),
            ProxyError::Overloaded(4),
            ProxyError::NoRank(NoRank::NoTelemetry),
            ProxyError::NoRank(NoRank::ShapeUnknown),
            ProxyError::Timeout(ms).at(w),
            ProxyError::EngineBusy {
                limit: 3,
                waited: ms,
            }
            .at(w),
            ProxyError::StaleConnection {
                engine: "http://10.9.8.7:8000".into(),
                reason: "reset".into(),
            }
            .at(w),
            ProxyError::Internal("building URI: http://10.9.8.7".into()).at(w),
            upstream.at(w),
        ]
    }

    #[test]
    fn by_default_errors_name_no_address_and_no_setting() {
        let w = member(Some("decode-a"));
        for e in errors(&w) {
            let m = Exposure::new(ExposeWorker::None).error(&e);
            assert!(!m.contains("10.9.8.7") && !m.contains("decode-a"), "{m}");
            for key in ["server.", "routing.", "engines[", "http://10"] {
                assert!(!m.contains(key), "{m}");
            }
        }
        assert_eq!(Exposure::new(ExposeWorker::None).worker(&w), None);
    }

    #[test]
    fn engine_headers_that_name_it_go_unless_url() {
        let sent = || {
            let mut h = HeaderMap::new();
            for n in &ENGINE_NAMING {
                h.append(n, HeaderValue::from_static("gpu-node-7.internal"));
            }
            h.append(header::SET_COOKIE, HeaderValue::from_static("b=2"));
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            h.insert("x-request-id", HeaderValue::from_static("r1"));
            h
        };
        for mode in [ExposeWorker::None, ExposeWorker::Name] {
            let mut h = sent();
            Exposure::new(mode).scrub(&mut h);
            let mut left: Vec<_> = h.keys().map(|k| k.as_str()).collect();
            left.sort_unstable();
            assert_eq!(left, ["content-type", "x-request-id"], "{mode:?}");
        }
        let mut h = sent();
        Exposure::new(ExposeWorker::Url).scrub(&mut h);
        assert_eq!(h.len(), sent().len());
    }

    #[test]
    fn name_shows_the_name_and_url_shows_everything() {
        let named = member(Some("decode-a"));
        let timeout = ProxyError::Timeout(Duration::from_millis(5)).at(&named);
        let by_name = Exposure::new(ExposeWorker::Name);
        assert_eq!(by_name.worker(&named).unwrap(), "decode-a@1");
        let m = by_name.error(&timeout);
        assert!(
            m.starts_with("decode-a@1: ") && !m.contains("10.9.8.7"),
            "{m}"
        );
        // A nameless engine is not named at all.
        let nameless = member(None);
        assert_eq!(by_name.worker(&nameless), None);
        let m = by_name.error(&ProxyError::Timeout(Duration::ZERO).at(&nameless));
        assert!(!m.contains("10.9.8.7") && !m.contains('@'), "{m}");

        let url = Exposure::new(ExposeWorker::Url);
        assert_eq!(url.worker(&named).unwrap(), "http://10.9.8.7:8000@1");
        let m = url.error(&timeout);
        assert!(m.starts_with("http://10.9.8.7:8000@1: ") && m.contains("server.response_timeout"));
        let cut = StreamError::Idle(Duration::from_millis(7));
        assert!(url
            .stream(Some(&named), &cut)
            .contains("server.stream_idle_timeout"));
        let m = Exposure::new(ExposeWorker::None).stream(Some(&named), &cut);
        assert_eq!(m, "the engine sent nothing for 7 ms");
    }
}
