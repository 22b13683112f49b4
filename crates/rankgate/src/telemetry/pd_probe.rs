//! `rankgate check --probe`, for prefill servers: what makes a prefill/decode fleet fail every
//! request while every engine answers its health and metrics. An SGLang prefill server whose
//! bootstrap port does not answer (the decode servers fetch each request's KV there: a wrong
//! `bootstrap_port` fails every request with the decode's 500), and a vLLM prefill server that
//! returns no `kv_transfer_params` for a one-token prefill request (started without a KV
//! connector: every request 502). Each found problem names the engine and the likely cause.
//!
//! The vLLM probe is one real prefill of a one-word prompt: the server keeps its block for a
//! decode that never comes, until its lease runs out (`VLLM_NIXL_ABORT_REQUEST_TIMEOUT`).

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};

use crate::config::{Engine, Flavor, Role, SGLANG_BOOTSTRAP_PORT};

/// Largest prefill answer read: a one-token completion is small.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// What a vLLM prefill server is asked: one token, the blocks kept for a remote decode (as the
/// router's prefill leg asks).
const PROBE_PARAMS: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// One prefill server to probe: the engine, its flavor as configured or read, and a model it
/// serves (the vLLM probe names one).
#[derive(Debug, Clone)]
pub struct PrefillServer {
    pub engine: Engine,
    pub flavor: Option<Flavor>,
    pub model: Option<String>,
}

/// Probes each prefill server, all at once, each bounded by `timeout`; one line per problem
/// found, naming the engine and what is likely wrong.
pub async fn probe(
    servers: Vec<PrefillServer>,
    timeout: Duration,
    upstream: &crate::tls::Upstream,
) -> Vec<String> {
    let client = crate::http::client_with::<Full<Bytes>>(timeout, upstream);
    let tasks: Vec<_> = (servers.into_iter())
        .filter(|s| s.engine.role == Role::Prefill && s.engine.http)
        .map(|s| {
            let client = client.clone();
            tokio::spawn(async move {
                let answer = match s.flavor {
                    Some(Flavor::Sglang) => bootstrap(&s.engine, timeout).await,
                    Some(Flavor::Vllm) => prefill(&client, &s, timeout).await,
                    _ => Ok(()),
                };
                answer.err().map(|why| format!("{}: {why}", s.engine.url))
            })
        })
        .collect();
    let mut problems = Vec::new();
    for t in tasks {
        if let Ok(Some(p)) = t.await {
            problems.push(p);
        }
    }
    problems
}

/// An SGLang prefill server's bootstrap port takes a TCP connection.
async fn bootstrap(e: &Engine, timeout: Duration) -> Result<(), String> {
    let port = e.bootstrap_port.unwrap_or(SGLANG_BOOTSTRAP_PORT);
    let host = host_of(&e.authority);
    let addr = format!("{host}:{port}");
    let wrong = |why: String| {
        format!(
            "bootstrap_port {port} does not answer ({why}): the decode servers fetch each request's KV there, so every request would fail; set `bootstrap_port` to the prefill server's --disaggregation-bootstrap-port"
        )
    };
    match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(&addr)).await {
        Err(_) => Err(wrong(format!(
            "no connection to {addr} within {} ms",
            timeout.as_millis()
        ))),
        Ok(Err(err)) => Err(wrong(format!("{addr}: {err}"))),
        Ok(Ok(_)) => Ok(()),
    }
}

/// The host of `host:port` (an IPv6 address without its brackets kept with them, as a
/// connect address needs).
fn host_of(authority: &str) -> &str {
    match authority.rfind(':') {
        Some(i) if !authority[i..].contains(']') => &authority[..i],
        _ => authority,
    }
}

/// A vLLM prefill server answers a one-token prefill with `kv_transfer_params`.
async fn prefill(
    client: &crate::http::HttpClient<Full<Bytes>>,
    s: &PrefillServer,
    timeout: Duration,
) -> Result<(), String> {
    let Some(model) = &s.model else {
        return Err("no model known to send a one-token prefill request with (its /v1/models did not answer, and `models` is not set)".into());
    };
    let body = serde_json::json!({
        "model": model,
        "prompt": "rankgate check",
        "max_tokens": 1,
        "stream": false,
        "kv_transfer_params": serde_json::from_str::<serde_json::Value>(PROBE_PARAMS)
            .map_err(|e| e.to_string())?,
    });
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(format!("{}/v1/completions", s.engine.url))
        .header(http::header::CONTENT_TYPE, "application/json");
    if let Some(key) = &s.engine.api_key {
        req = req.header(http::header::AUTHORIZATION, key.0.clone());
    }
    let req = req
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| format!("POST /v1/completions: {e}"))?;
    let exchange = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| crate::http::error_chain(&e))?;
        let status = resp.status();
        let bytes = Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| crate::http::error_chain(&*e))?
            .to_bytes();
        Ok::<_, String>((status, bytes))
    };
    let (status, bytes) = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| {
            format!(
                "POST /v1/completions (one-token prefill): no answer within {} ms",
                timeout.as_millis()
            )
        })?
        .map_err(|e| format!("POST /v1/completions (one-token prefill): {e}"))?;
    if status != StatusCode::OK {
        return Err(format!(
            "POST /v1/completions (one-token prefill) answered {status}: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        ));
    }
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    match v.get("kv_transfer_params") {
        Some(p) if p.is_object() => Ok(()),
        _ => Err("returned no kv_transfer_params for a one-token prefill request: it was likely started without a KV connector (vLLM: --kv-transfer-config with kv_connector NixlConnector and kv_role kv_producer), so every disaggregated request would fail (502); start it with one, or remove its role".into()),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_host_of_an_authority_keeps_ipv6_brackets() {
        assert_eq!(super::host_of("10.0.0.1:8000"), "10.0.0.1");
        assert_eq!(super::host_of("[::1]:8000"), "[::1]");
        assert_eq!(super::host_of("engine"), "engine");
    }
}
