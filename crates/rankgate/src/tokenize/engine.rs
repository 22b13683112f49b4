//! The opt-in fallback: ask the engine itself (vLLM's `POST /tokenize`) for a request's token
//! ids when the router has no tokenizer for the model. It costs a round trip to the engine
//! before routing, so the latency is returned for the caller to count.
//!
//! vLLM 0.32 takes `{"model", "messages", "add_generation_prompt", ...}` (the chat form) or
//! `{"model", "prompt", "add_special_tokens"}` (the completions form) and answers
//! `{"count", "max_model_len", "tokens", "token_strs"}`. The fields of the client's body that
//! change the tokens are copied as the client wrote them; the engine applies its own defaults
//! (`add_generation_prompt` true, chat `add_special_tokens` false), the same as for the request.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::Connect;
use hyper_util::client::legacy::Client;
use serde::Deserialize;
use serde_json::value::RawValue;
use tokio::time::Instant;

use super::error::TokenizeError;

/// Which endpoint's body is being tokenized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizeRequest {
    /// A `/v1/chat/completions` body.
    Chat,
    /// A `/v1/completions` body.
    Completion,
}

/// The engine's answer, and how long it took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineTokens {
    pub tokens: Vec<u32>,
    pub count: Option<u64>,
    pub max_model_len: Option<u64>,
    /// From sending the request to the whole answer read.
    pub latency: Duration,
}

/// The fields of the client's body that `/tokenize` takes, per kind.
const CHAT_FIELDS: [&str; 8] = [
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "tools",
    "documents",
    "chat_template_kwargs",
];
const COMPLETION_FIELDS: [&str; 3] = ["model", "prompt", "add_special_tokens"];

/// A `/tokenize` answer larger than this is refused (a 32k-token answer is ~200 KB).
const MAX_ANSWER_BYTES: usize = 4 * 1024 * 1024;

#[derive(Deserialize)]
struct Answer {
    tokens: Vec<u32>,
    count: Option<u64>,
    max_model_len: Option<u64>,
}

/// The `/tokenize` body for a client's request body: the fields that change the tokens.
pub fn tokenize_body(kind: TokenizeRequest, body: &[u8]) -> Result<Vec<u8>, TokenizeError> {
    let fields: std::collections::HashMap<&str, &RawValue> =
        serde_json::from_slice(body).map_err(|e| TokenizeError::Body(e.to_string()))?;
    let keep: &[&str] = match kind {
        TokenizeRequest::Chat => &CHAT_FIELDS,
        TokenizeRequest::Completion => &COMPLETION_FIELDS,
    };
    let mut out_raw: Vec<(&str, &RawValue)> = Vec::new();
    for key in keep {
        if let Some(value) = fields.get(key) {
            out_raw.push((key, value));
        }
    }
    let mut text = String::from("{");
    for (i, (key, value)) in out_raw.iter().enumerate() {
        if i > 0 {
            text.push(',');
        }
        text.push_str(&serde_json::to_string(key).map_err(|e| TokenizeError::Body(e.to_string()))?);
        text.push(':');
        text.push_str(value.get());
    }
    text.push('}');
    Ok(text.into_bytes())
}

/// Asks the engine at `base` (`http://host:port`) for the tokens of the client's `body`,
/// within `timeout` for the whole exchange. `client` is any hyper client (the router's own
/// upstream client in production).
pub async fn engine_tokenize<C>(
    client: &Client<C, Full<Bytes>>,
    base: &str,
    kind: TokenizeRequest,
    body: &[u8],
    timeout: Duration,
) -> Result<EngineTokens, TokenizeError>
where
    C: Connect + Clone + Send + Sync + 'static,
{
    let uri = format!("{}/tokenize", base.trim_end_matches('/'));
    let fail = |detail: String| TokenizeError::Engine {
        uri: uri.clone(),
        detail,
    };
    let request = http::Request::post(&uri)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(tokenize_body(kind, body)?)))
        .map_err(|e| fail(e.to_string()))?;
    let started = Instant::now();
    let exchange = async {
        let response = client
            .request(request)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| fail(format!("reading the answer: {e}")))?
            .to_bytes();
        if !status.is_success() {
            let text = String::from_utf8_lossy(&bytes[..bytes.len().min(512)]).into_owned();
            return Err(fail(format!("status {status}: {text}")));
        }
        serde_json::from_slice::<Answer>(&bytes).map_err(|e| fail(format!("answer: {e}")))
    };
    let answer = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| fail(format!("no answer within {timeout:?}")))??;
    Ok(EngineTokens {
        tokens: answer.tokens,
        count: answer.count,
        max_model_len: answer.max_model_len,
        latency: started.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_keeps_the_fields_that_change_tokens_as_written() {
        let body = br#"{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "add_generation_prompt": false}"#;
        let out = tokenize_body(TokenizeRequest::Chat, body).unwrap();
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"model":"m","messages":[{"role": "user", "content": "hi"}],"add_generation_prompt":false}"#
        );
        let out =
            tokenize_body(TokenizeRequest::Completion, br#"{"prompt": "x", "n": 2}"#).unwrap();
        assert_eq!(std::str::from_utf8(&out).unwrap(), r#"{"prompt":"x"}"#);
        assert!(tokenize_body(TokenizeRequest::Chat, b"[1]").is_err());
    }
}
