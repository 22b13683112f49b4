//! A chat request's messages reshaped as vLLM 0.32 hands them to the chat template
//! (`vllm/entrypoints/chat_utils.py`): role and content first (content a string, text parts
//! joined by "\n", or a list of text parts when the template walks parts), then the assistant's
//! `tool_calls` with each `function.arguments` parsed from its JSON string, a tool message's
//! `tool_call_id`, and `name`. Other keys are dropped, as vLLM drops them. Parts that are not
//! text (images, audio) are refused: vLLM writes a model-specific placeholder for them.

use minijinja::value::{Serde, ValueKind};
use minijinja::Value;

use super::error::TokenizeError;

/// `messages[index]` put in front of a body error.
pub(crate) fn at(index: usize, e: TokenizeError) -> TokenizeError {
    match e {
        TokenizeError::Body(detail) => TokenizeError::Body(format!("messages[{index}]: {detail}")),
        other => other,
    }
}

/// One message as vLLM hands it to the template: role, content (a string, or a list of text
/// parts when the template walks parts), then `tool_calls` (arguments parsed), `tool_call_id`
/// and `name` when given. Keys are kept in that order (`tojson(message)` prints them).
pub(crate) fn message(m: &Value, wants_parts: bool) -> Result<Value, TokenizeError> {
    if m.kind() != ValueKind::Map {
        return Err(TokenizeError::Body("not an object".into()));
    }
    let field = |key: &str| m.get_attr(key).ok().filter(|v| !v.is_undefined());
    let role = field("role")
        .filter(|r| r.as_str().is_some())
        .ok_or_else(|| TokenizeError::Body("no string role".into()))?;
    let texts: Vec<String> = match field("content") {
        None => Vec::new(),
        Some(c) if c.is_none() => Vec::new(),
        Some(c) if c.kind() == ValueKind::String => vec![c.as_str().unwrap_or_default().into()],
        Some(c) if c.kind() == ValueKind::Seq => {
            let mut texts = Vec::new();
            for part in c
                .try_iter()
                .map_err(|e| TokenizeError::Body(e.to_string()))?
            {
                let kind = part.get_attr("type").ok();
                match kind.as_ref().and_then(Value::as_str) {
                    Some("text") => {
                        let text = part.get_attr("text").ok();
                        let text = text.as_ref().and_then(Value::as_str).ok_or_else(|| {
                            TokenizeError::Body("a text part without a string text".into())
                        })?;
                        texts.push(text.to_string());
                    }
                    // Images, audio...: vLLM writes a model-specific placeholder; not here.
                    other => {
                        return Err(TokenizeError::Body(format!(
                            "content part of type {other:?} is not tokenized here"
                        )))
                    }
                }
            }
            texts
        }
        Some(_) => {
            return Err(TokenizeError::Body(
                "content: not a string or a list".into(),
            ))
        }
    };
    let content = if wants_parts {
        let parts: Vec<Value> = texts
            .into_iter()
            .map(|text| {
                Value::from(Serde(Ordered(vec![
                    ("type", "text".into()),
                    ("text", text.into()),
                ])))
            })
            .collect();
        Value::from(parts)
    } else {
        Value::from(texts.join("\n"))
    };
    let mut fields: Vec<(&str, Value)> = vec![("role", role.clone()), ("content", content)];
    if role.as_str() == Some("assistant") {
        if let Some(calls) = field("tool_calls").filter(|c| !c.is_none()) {
            fields.push(("tool_calls", tool_calls(&calls)?));
        }
    }
    if role.as_str() == Some("tool") {
        if let Some(id) = field("tool_call_id") {
            fields.push(("tool_call_id", id));
        }
    }
    if let Some(name) = field("name").filter(|n| n.as_str().is_some()) {
        fields.push(("name", name));
    }
    Ok(Value::from(Serde(Ordered(fields))))
}

/// The final message's text, for `continue_final_message`.
pub(crate) fn final_content(m: &Value) -> Option<String> {
    let content = m.get_attr("content").ok()?;
    if let Some(text) = content.as_str() {
        return Some(text.to_string());
    }
    let parts = content.try_iter().ok()?;
    let last = parts.last()?;
    last.get_attr("text").ok()?.as_str().map(str::to_string)
}

/// Tool calls with each `function.arguments` JSON string parsed into its value, as vLLM does
/// before the template (templates print `arguments | tojson`); a missing one becomes `{}`.
fn tool_calls(calls: &Value) -> Result<Value, TokenizeError> {
    let bad = |d: &str| TokenizeError::Body(format!("tool_calls: {d}"));
    let mut out = Vec::new();
    for call in calls.try_iter().map_err(|_| bad("not a list"))? {
        if call.kind() != ValueKind::Map {
            return Err(bad("an entry is not an object"));
        }
        let mut fields: Vec<(String, Value)> = Vec::new();
        for key in call.try_iter().map_err(|e| bad(&e.to_string()))? {
            let value = call.get_item(&key).map_err(|e| bad(&e.to_string()))?;
            let key = key.as_str().unwrap_or_default().to_string();
            let value = if key == "function" && value.kind() == ValueKind::Map {
                function(&value).map_err(|d| bad(&d))?
            } else {
                value
            };
            fields.push((key, value));
        }
        out.push(Value::from(Serde(Ordered(fields))));
    }
    Ok(Value::from(out))
}

fn function(f: &Value) -> Result<Value, String> {
    let mut fields: Vec<(String, Value)> = Vec::new();
    let mut has_arguments = false;
    for key in f.try_iter().map_err(|e| e.to_string())? {
        let value = f.get_item(&key).map_err(|e| e.to_string())?;
        let key = key.as_str().unwrap_or_default().to_string();
        let value = if key == "arguments" {
            has_arguments = true;
            match value.as_str() {
                Some("") => Value::from(Serde(Ordered::<String>(Vec::new()))),
                Some(json) => serde_json::from_str::<Value>(json)
                    .map_err(|e| format!("arguments: not JSON: {e}"))?,
                None if value.is_none() => Value::from(Serde(Ordered::<String>(Vec::new()))),
                None => value,
            }
        } else {
            value
        };
        fields.push((key, value));
    }
    if !has_arguments {
        fields.push((
            "arguments".into(),
            Value::from(Serde(Ordered::<String>(Vec::new()))),
        ));
    }
    Ok(Value::from(Serde(Ordered(fields))))
}

/// A map with its keys in the given order (minijinja keeps a serialized map's order).
struct Ordered<K>(Vec<(K, Value)>);

impl<K: serde::Serialize> serde::Serialize for Ordered<K> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}
