//! The engine calls a load makes: vLLM's `POST /v1/load_lora_adapter` and
//! `/v1/unload_lora_adapter`, each bounded in time and in the answer read, a refusal told in the
//! engine's own words.

use bytes::Bytes;
use http::{header, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use serde_json::{json, Value};

use crate::worker::EngineEntry;

/// Longest one load or unload may take: vLLM reads the adapter's files (from disk, or from the
/// Hub for a repository id) before it answers.
pub const LOAD_WITHIN: std::time::Duration = std::time::Duration::from_secs(60);
/// Largest engine answer read: vLLM's are one line.
const MAX_ANSWER: usize = 64 * 1024;
/// Longest piece of an engine's answer an error repeats.
const MAX_SHOWN: usize = 300;

/// Why a call failed: the engine's status, when it answered, and what went wrong.
pub type Refusal = (Option<StatusCode>, String);

pub type Client = crate::http::HttpClient<Full<Bytes>>;

/// A call's answer.
pub type Answer = Result<(), Refusal>;

/// Loads `name` from `path` on `engine`; one it has already counts as loaded.
pub async fn load(
    client: &Client,
    engine: &EngineEntry,
    name: &str,
    path: &str,
) -> Result<(), Refusal> {
    let body = json!({"lora_name": name, "lora_path": path});
    let r = match post(client, engine, "/v1/load_lora_adapter", body).await {
        Err((Some(StatusCode::BAD_REQUEST), why)) if why.contains("already been loaded") => Ok(()),
        r => r,
    };
    match &r {
        Ok(()) => tracing::info!(adapter = %name, server = %engine.url, "loaded a LoRA adapter"),
        Err((_, why)) => {
            tracing::warn!(adapter = %name, server = %engine.url, error = %why, "loading a LoRA adapter failed")
        }
    }
    r
}

/// Unloads `name` from `engine`; with `gone_is_done`, one it does not have counts as unloaded.
pub async fn unload(
    client: &Client,
    engine: &EngineEntry,
    name: &str,
    gone_is_done: bool,
) -> Result<(), Refusal> {
    let body = json!({"lora_name": name});
    let r = match post(client, engine, "/v1/unload_lora_adapter", body).await {
        Err((Some(StatusCode::NOT_FOUND), why))
            if gone_is_done && why.contains("cannot be found") =>
        {
            Ok(())
        }
        r => r,
    };
    match &r {
        Ok(()) => tracing::info!(adapter = %name, server = %engine.url, "unloaded a LoRA adapter"),
        Err((_, why)) => {
            tracing::warn!(adapter = %name, server = %engine.url, error = %why, "unloading a LoRA adapter failed")
        }
    }
    r
}

/// One POST of `body` to `engine`, within [`LOAD_WITHIN`].
async fn post(
    client: &Client,
    engine: &EngineEntry,
    path: &str,
    body: Value,
) -> Result<(), Refusal> {
    let uri = format!("{}{path}", engine.url);
    let mut req = Request::post(&uri)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| (None, format!("{uri}: {e}")))?;
    if let Some(key) = &engine.api_key {
        req.headers_mut()
            .insert(header::AUTHORIZATION, key.0.clone());
    }
    let answer = async {
        let resp = (client.request(req).await).map_err(|e| (None, crate::http::error_chain(&e)))?;
        let status = resp.status();
        let text = match Limited::new(resp.into_body(), MAX_ANSWER).collect().await {
            Ok(b) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
            Err(e) => format!("(its answer could not be read: {e})"),
        };
        match status.is_success() {
            true => Ok(()),
            false => Err((Some(status), format!("{status}: {}", message(&text)))),
        }
    };
    match tokio::time::timeout(LOAD_WITHIN, answer).await {
        Ok(r) => r,
        Err(_) => Err((
            None,
            format!("no answer within {} s", LOAD_WITHIN.as_secs()),
        )),
    }
}

/// An engine's error answer as its message says it (OpenAI's `error.message`), else its text,
/// cut to [`MAX_SHOWN`] characters.
fn message(text: &str) -> String {
    let said = serde_json::from_str::<Value>(text).ok().and_then(|v| {
        v.pointer("/error/message")
            .or_else(|| v.get("message"))
            .and_then(Value::as_str)
            .map(str::to_string)
    });
    let said = said.unwrap_or_else(|| text.trim().to_string());
    match said.char_indices().nth(MAX_SHOWN) {
        Some((cut, _)) => format!("{}...", &said[..cut]),
        None => said,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engines_refusal_is_shown_in_its_own_words_and_bounded() {
        let vllm = r#"{"error":{"message":"Loading lora x failed: No adapter found for /nope","type":"NotFoundError","param":null,"code":404}}"#;
        assert_eq!(
            message(vllm),
            "Loading lora x failed: No adapter found for /nope"
        );
        assert_eq!(
            message("  Internal Server Error\n"),
            "Internal Server Error"
        );
        let long = "y".repeat(1000);
        assert_eq!(message(&long).len(), MAX_SHOWN + 3);
    }
}
