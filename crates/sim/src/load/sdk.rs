//! The requests the official `openai` Python SDK sends, as it sends them (paths, bodies, the
//! headers it adds), for `rankgate openai-client` and the tests that run the same sequence
//! against a router: a client of rankgate should see exactly what it would see from one engine.

use bytes::Bytes;
use http::{header, Method, Request};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

/// One SDK call: what the SDK method is called, and the request it makes.
pub struct Call {
    pub name: &'static str,
    pub method: Method,
    pub path: String,
    pub body: Option<Value>,
}

/// The SDK calls an application makes first: chat (whole and streamed), the model list and one
/// model, a response, an embedding.
pub fn calls(model: &str) -> Vec<Call> {
    let chat = |stream: bool| {
        json!({
            "model": model,
            "messages": [{"role": "user", "content": "Say hi"}],
            "max_completion_tokens": 8,
            "stream": stream,
        })
    };
    let call = |name, method, path: &str, body| Call {
        name,
        method,
        path: path.to_string(),
        body,
    };
    vec![
        call(
            "chat.completions.create",
            Method::POST,
            "/v1/chat/completions",
            Some(chat(false)),
        ),
        call(
            "chat.completions.create(stream=True)",
            Method::POST,
            "/v1/chat/completions",
            Some(chat(true)),
        ),
        call("models.list", Method::GET, "/v1/models", None),
        call(
            "models.retrieve",
            Method::GET,
            &format!("/v1/models/{model}"),
            None,
        ),
        call(
            "responses.create",
            Method::POST,
            "/v1/responses",
            Some(
                json!({"model": model, "input": "Say hi", "max_output_tokens": 8, "store": false}),
            ),
        ),
        // The Python SDK asks for base64 embeddings unless told otherwise.
        call(
            "embeddings.create",
            Method::POST,
            "/v1/embeddings",
            Some(json!({"model": model, "input": "hello", "encoding_format": "base64"})),
        ),
    ]
}

/// What a call got back.
#[derive(Debug)]
pub struct Outcome {
    pub status: http::StatusCode,
    /// The `x-rankgate-worker` that served it (none for rankgate's own answers).
    pub worker: Option<String>,
    pub request_id: Option<String>,
    pub body: Bytes,
}

impl Outcome {
    pub fn json(&self) -> Option<Value> {
        serde_json::from_slice(&self.body).ok()
    }
}

/// Longest a call may take, answer and body included: these calls are short, and a server that
/// never answers must not hang the client or a test.
pub const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Makes `call` against `base` (e.g. `http://127.0.0.1:8080`) with the SDK's headers, within
/// [`CALL_TIMEOUT`].
pub async fn send(
    client: &rankgate::http::HttpClient<Full<Bytes>>,
    base: &str,
    api_key: &str,
    call: &Call,
) -> Result<Outcome, String> {
    send_as(client, base, api_key, None, call).await
}

/// [`send`], asking with rankgate's `admin_token` (if any) which rank serves the call.
pub async fn send_as(
    client: &rankgate::http::HttpClient<Full<Bytes>>,
    base: &str,
    api_key: &str,
    admin_token: Option<&str>,
    call: &Call,
) -> Result<Outcome, String> {
    let exchange = exchange(client, base, api_key, admin_token, call);
    tokio::time::timeout(CALL_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("no complete answer within {CALL_TIMEOUT:?}"))?
}

async fn exchange(
    client: &rankgate::http::HttpClient<Full<Bytes>>,
    base: &str,
    api_key: &str,
    admin_token: Option<&str>,
    call: &Call,
) -> Result<Outcome, String> {
    let body = call
        .body
        .as_ref()
        .map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
    let stream = call.body.as_ref().is_some_and(|b| b["stream"] == true);
    let mut req = Request::builder()
        .method(call.method.clone())
        .uri(format!("{base}{}", call.path))
        .header(header::AUTHORIZATION, format!("Bearer {api_key}"))
        .header(
            header::ACCEPT,
            if stream {
                "text/event-stream"
            } else {
                "application/json"
            },
        )
        .header(header::USER_AGENT, "OpenAI/Python 1.99.0")
        .header("x-stainless-lang", "python")
        .header("x-stainless-package-version", "1.99.0")
        .header("x-stainless-retry-count", "0");
    if call.body.is_some() {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    if let Some(t) = admin_token {
        req = (req.header(super::DEBUG_HEADER, "1")).header(super::ADMIN_TOKEN_HEADER, t);
    }
    let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| rankgate::http::error_chain(&e))?;
    let header_text = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let (worker, request_id) = (
        header_text("x-rankgate-worker"),
        header_text("x-request-id"),
    );
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok(Outcome {
        status,
        worker,
        request_id,
        body,
    })
}
