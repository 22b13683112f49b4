//! API keys the way `--api-key` makes each engine check them, so a router's key handling meets
//! the same answers as in production: which paths need the key, which headers carry it, and the
//! 401 body.
//!
//! - vLLM guards only the paths under `/v1`, `/v2`, `/inference` and `/cohere` (a plain prefix
//!   test); `/health`, `/metrics`, `/load`, `/tokenize`, `/detokenize`, `/pooling`, `/classify`,
//!   `/score` and `/rerank` stay open. The key comes as `Authorization: Bearer K` (the scheme in
//!   any case) or, since the Anthropic-compatible API, as `x-api-key: K`.
//! - SGLang guards every path except those starting with `/health` or `/metrics`, so its
//!   `/v1/loads` telemetry and `/get_server_info` need the key too. The header must read exactly
//!   `Bearer K`.
//!
//! Both let `OPTIONS` (CORS preflight) through and refuse with 401 `{"error": "Unauthorized"}`
//! before reading the body.

use http::{header, HeaderMap, Method};

use super::SimFlavor;

/// The 401 body both engines answer with.
pub(super) const UNAUTHORIZED: &str = r#"{"error":"Unauthorized"}"#;

/// vLLM's guarded path prefixes.
const VLLM_GUARDED: [&str; 4] = ["/v1", "/v2", "/inference", "/cohere"];

/// SGLang's open path prefixes.
const SGLANG_OPEN: [&str; 2] = ["/health", "/metrics"];

/// Whether a request to `path` must carry the key.
pub(super) fn guarded(flavor: SimFlavor, method: &Method, path: &str) -> bool {
    if method == Method::OPTIONS {
        return false;
    }
    match flavor {
        SimFlavor::Vllm => VLLM_GUARDED.iter().any(|p| path.starts_with(p)),
        SimFlavor::Sglang => !SGLANG_OPEN.iter().any(|p| path.starts_with(p)),
    }
}

/// Whether `headers` carry `key` in a form the engine accepts.
pub(super) fn accepted(flavor: SimFlavor, headers: &HeaderMap, key: &str) -> bool {
    let authorization = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match flavor {
        SimFlavor::Vllm => {
            // vLLM splits at the first space and compares the scheme case-insensitively.
            let bearer = authorization.and_then(|a| a.split_once(' '));
            let bearer_ok = bearer.is_some_and(|(scheme, token)| {
                scheme.eq_ignore_ascii_case("bearer") && token == key
            });
            let x_api_key = headers.get("x-api-key");
            bearer_ok || x_api_key.is_some_and(|v| v.as_bytes() == key.as_bytes())
        }
        SimFlavor::Sglang => authorization
            .and_then(|a| a.strip_prefix("Bearer "))
            .is_some_and(|token| token == key),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn vllm_guards_versioned_prefixes_only() {
        let post = Method::POST;
        for p in [
            "/v1/chat/completions",
            "/v1/models",
            "/v2/rerank",
            "/inference/v1/generate",
        ] {
            assert!(guarded(SimFlavor::Vllm, &post, p), "{p}");
        }
        for p in [
            "/health",
            "/metrics",
            "/tokenize",
            "/score",
            "/rerank",
            "/pooling",
            "/load",
        ] {
            assert!(!guarded(SimFlavor::Vllm, &post, p), "{p}");
        }
        assert!(!guarded(SimFlavor::Vllm, &Method::OPTIONS, "/v1/models"));
    }

    #[test]
    fn sglang_guards_all_but_health_and_metrics() {
        let get = Method::GET;
        for p in ["/v1/loads", "/generate", "/get_server_info", "/v1/models"] {
            assert!(guarded(SimFlavor::Sglang, &get, p), "{p}");
        }
        for p in ["/health", "/health_generate", "/metrics"] {
            assert!(!guarded(SimFlavor::Sglang, &get, p), "{p}");
        }
    }

    #[test]
    fn key_forms_per_engine() {
        let vllm = |h| accepted(SimFlavor::Vllm, &h, "k");
        let sglang = |h| accepted(SimFlavor::Sglang, &h, "k");
        assert!(vllm(headers(&[("authorization", "Bearer k")])));
        assert!(vllm(headers(&[("authorization", "bearer k")])));
        assert!(vllm(headers(&[("x-api-key", "k")])));
        assert!(!vllm(headers(&[("authorization", "Bearer kk")])));
        assert!(!vllm(headers(&[("authorization", "Basic k")])));
        assert!(!vllm(headers(&[])));
        assert!(sglang(headers(&[("authorization", "Bearer k")])));
        assert!(!sglang(headers(&[("authorization", "bearer k")])));
        assert!(!sglang(headers(&[("x-api-key", "k")])));
    }
}
