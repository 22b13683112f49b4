//! [`ChatTokenizer`]: a request body to the token ids vLLM's OpenAI server would compute.
//!
//! Chat (`/v1/chat/completions`, vLLM 0.32): the messages are reshaped as vLLM does before the
//! template (content parts joined by "\n", or every content made a list of parts when the
//! template walks them; tool-call `arguments` parsed from their JSON string), the template is
//! rendered with `add_generation_prompt` (default true) and the special tokens, and the text is
//! tokenized with `add_special_tokens` false (the template already wrote BOS). Completions
//! (`/v1/completions`): the prompt string is tokenized with `add_special_tokens` true, so the
//! post-processor in tokenizer.json decides BOS/EOS; a list of token ids is taken as it is.
//!
//! The cap ([`Limits`]): the rendered text is cut before tokenizing at a point where the
//! engine's tokens provably do not depend on what follows, so the ids returned are exactly the
//! engine's first ones:
//! - at the start of an added token written in the text (`</s>`, `<|im_end|>`...): the
//!   tokenizer splits the text at added tokens before normalizing or pre-tokenizing anything,
//!   so what precedes one is tokenized on its own in any tokenizer;
//! - for byte-level BPE tokenizers (GPT-2's pre-tokenizer regex, a normalizer that leaves ASCII
//!   alone), also between an ASCII letter and a space followed by an ASCII letter: every
//!   pre-token before it ends there whatever follows, and BPE never merges across pre-tokens.
//!
//! Then the ids are cut at `max_tokens`.

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::value::{Serde, ValueKind};
use minijinja::Value;
use serde::Deserialize;

use super::error::TokenizeError;
use super::files::{self, Config, TokenizerFiles};
use super::template::ChatTemplate;

/// How much of a prompt is tokenized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of rendered prompt text tokenized at most; the text is cut at the last safe point
    /// at or before this.
    pub max_bytes: usize,
    /// Token ids returned at most.
    pub max_tokens: usize,
}

impl Limits {
    /// 32k tokens of prefix (256 blocks of 128 tokens); 256 KiB of text holds them at the ~4
    /// bytes a token of English text and code (byte-level BPE makes at most one token a byte,
    /// so a dense prompt reaches `max_tokens` first).
    pub const DEFAULT: Limits = Limits {
        max_bytes: 256 * 1024,
        max_tokens: 32 * 1024,
    };
}

impl Default for Limits {
    fn default() -> Limits {
        Limits::DEFAULT
    }
}

/// A prompt's leading token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokens {
    /// The engine's first token ids for this request.
    pub ids: Vec<u32>,
    /// Whether `ids` is the whole prompt (false: it was cut at the limits).
    pub complete: bool,
}

/// A model's tokenizer and chat template, loaded once, shared by every request (`&self` only;
/// `tokenizers::Tokenizer` and the template are read-only once built).
pub struct ChatTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// Chat templates by name ("default", "tool_use", ...); empty when the model has none.
    templates: Vec<(String, ChatTemplate)>,
    config: Config,
    /// Added tokens the text may be cut before (see the module doc).
    cut_tokens: Vec<String>,
    /// Whether the byte-level letter-space-letter cut is exact for this tokenizer.
    word_cuts: bool,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    limits: Limits,
    /// Named in "no chat template" errors.
    dir: std::path::PathBuf,
}

impl std::fmt::Debug for ChatTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTokenizer")
            .field("dir", &self.dir)
            .field("templates", &self.templates)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// The fields of a chat completions body that change the prompt's tokens.
#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<Value>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    add_special_tokens: Option<bool>,
    tools: Option<Value>,
    documents: Option<Value>,
    chat_template_kwargs: Option<BTreeMap<String, Value>>,
}

/// The fields of a completions body that change the prompt's tokens.
#[derive(Deserialize)]
struct CompletionBody {
    prompt: serde_json::Value,
    add_special_tokens: Option<bool>,
}

impl ChatTokenizer {
    /// Loads the model directory `dir` (see [`TokenizerFiles::in_dir`]).
    pub fn from_dir(dir: &Path) -> Result<ChatTokenizer, TokenizeError> {
        ChatTokenizer::from_files(&TokenizerFiles::in_dir(dir)?)
    }

    /// Loads the files named in `files`, with [`Limits::DEFAULT`].
    pub fn from_files(files: &TokenizerFiles) -> Result<ChatTokenizer, TokenizeError> {
        let bytes = files::read(&files.tokenizer)?;
        let bad = |detail: String| TokenizeError::Tokenizer {
            path: files.tokenizer.clone(),
            detail,
        };
        let mut tokenizer =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| bad(e.to_string()))?;
        // transformers turns off any truncation or padding saved in tokenizer.json unless the
        // caller asks for it, and vLLM does not.
        tokenizer
            .with_truncation(None)
            .map_err(|e| bad(e.to_string()))?;
        tokenizer.with_padding(None);
        let word_cuts = byte_level_words(&bytes);
        let config = match &files.config {
            Some(path) => Config::load(path)?,
            None => Config::default(),
        };
        let templates = match &files.chat_template {
            Some(path) => {
                let source =
                    String::from_utf8(files::read(path)?).map_err(|_| TokenizeError::Template {
                        origin: path.display().to_string(),
                        detail: "not UTF-8".into(),
                    })?;
                vec![(
                    "default".to_string(),
                    ChatTemplate::new(source, path.display().to_string())?,
                )]
            }
            None => {
                let origin = files
                    .config
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default();
                config
                    .templates
                    .iter()
                    .map(|(name, source)| {
                        let origin = format!("{origin} chat_template {name:?}");
                        Ok((name.clone(), ChatTemplate::new(source.clone(), origin)?))
                    })
                    .collect::<Result<Vec<_>, TokenizeError>>()?
            }
        };
        let cut_tokens = tokenizer
            .get_added_tokens_decoder()
            .into_values()
            // Tokens matched after normalization or that eat the spaces before them or need
            // word boundaries do not start exactly where their text does.
            .filter(|t| !t.normalized && !t.lstrip && !t.single_word && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        let id = |name: &str| config.special(name).and_then(|t| tokenizer.token_to_id(t));
        Ok(ChatTokenizer {
            bos_id: id("bos_token"),
            eos_id: id("eos_token"),
            tokenizer,
            templates,
            config,
            cut_tokens,
            word_cuts,
            limits: Limits::DEFAULT,
            dir: files.dir(),
        })
    }

    /// The same tokenizer with other limits.
    pub fn with_limits(mut self, limits: Limits) -> ChatTokenizer {
        self.limits = limits;
        self
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The `tokenizers` tokenizer, for callers that tokenize text of their own (the simulator).
    pub fn tokenizer(&self) -> &tokenizers::Tokenizer {
        &self.tokenizer
    }

    /// The leading token ids of a chat completions request body.
    pub fn chat(&self, body: &[u8]) -> Result<Tokens, TokenizeError> {
        let (text, add_special_tokens) = self.render_chat(body)?;
        self.text(&text, add_special_tokens)
    }

    /// The prompt text a chat completions body renders to, and whether vLLM adds the
    /// tokenizer's special tokens when it tokenizes it (the body's `add_special_tokens`, false
    /// by default).
    pub fn render_chat(&self, body: &[u8]) -> Result<(String, bool), TokenizeError> {
        let body: ChatBody =
            serde_json::from_slice(body).map_err(|e| TokenizeError::Body(e.to_string()))?;
        let add_generation_prompt = body.add_generation_prompt.unwrap_or(true);
        let continue_final = body.continue_final_message.unwrap_or(false);
        if add_generation_prompt && continue_final {
            // vLLM answers 400 to this pair.
            return Err(TokenizeError::Body(
                "add_generation_prompt and continue_final_message cannot both be true".into(),
            ));
        }
        let tools = body.tools.filter(|t| !t.is_none());
        let template = self.template(tools.is_some())?;
        let messages = body
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| message(m, template.wants_parts).map_err(|e| at(i, e)))
            .collect::<Result<Vec<Value>, TokenizeError>>()?;
        let final_text = if continue_final {
            messages.last().and_then(final_content)
        } else {
            None
        };
        // transformers: render(messages, tools, documents, add_generation_prompt,
        // **special_tokens_map, **chat_template_kwargs).
        let mut context: BTreeMap<String, Value> = BTreeMap::new();
        for (name, content) in &self.config.specials {
            context.insert(name.clone(), Value::from(content.as_str()));
        }
        if !self.config.additional_special_tokens.is_empty() {
            context.insert(
                "additional_special_tokens".into(),
                Value::from(self.config.additional_special_tokens.clone()),
            );
        }
        for (key, value) in body.chat_template_kwargs.unwrap_or_default() {
            context.insert(key, value);
        }
        context.insert("messages".into(), Value::from(messages));
        context.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        context.insert("tools".into(), tools.unwrap_or_default());
        context.insert(
            "documents".into(),
            body.documents.filter(|d| !d.is_none()).unwrap_or_default(),
        );
        let mut text = template.render(Value::from(context))?;
        if let Some(final_text) = final_text {
            // transformers: keep the render up to the final message's (stripped) content, so
            // the model continues it instead of starting a new turn.
            let needle = final_text.trim();
            match text.rfind(needle) {
                Some(at) => text.truncate(at + needle.len()),
                None => {
                    return Err(TokenizeError::Render {
                        origin: template.origin().to_string(),
                        detail: "continue_final_message: the final message's content is not in the rendered prompt".into(),
                    })
                }
            }
        }
        Ok((text, body.add_special_tokens.unwrap_or(false)))
    }

    /// The leading token ids of a completions request body: a prompt string, or token ids
    /// given by the client. A batch of prompts is refused (which one would be routed?).
    pub fn completion(&self, body: &[u8]) -> Result<Tokens, TokenizeError> {
        let body: CompletionBody =
            serde_json::from_slice(body).map_err(|e| TokenizeError::Body(e.to_string()))?;
        let add_special_tokens = body.add_special_tokens.unwrap_or(true);
        match &body.prompt {
            serde_json::Value::String(prompt) => self.prompt(prompt, add_special_tokens),
            serde_json::Value::Array(items) if items.iter().all(|v| v.is_u64()) => {
                let mut ids = Vec::with_capacity(items.len().min(self.limits.max_tokens));
                for item in items.iter().take(self.limits.max_tokens) {
                    let id = item.as_u64().and_then(|id| u32::try_from(id).ok());
                    ids.push(id.ok_or_else(|| TokenizeError::Body("a token id over u32".into()))?);
                }
                Ok(Tokens {
                    complete: items.len() <= self.limits.max_tokens,
                    ids,
                })
            }
            serde_json::Value::Array(items) if items.len() == 1 => match &items[0] {
                serde_json::Value::String(prompt) => self.prompt(prompt, add_special_tokens),
                _ => Err(TokenizeError::Body(
                    "prompt: a one-item list that is not a string".into(),
                )),
            },
            _ => Err(TokenizeError::Body(
                "prompt: not a string or a list of token ids (batches are not tokenized)".into(),
            )),
        }
    }

    /// A completions prompt string's leading token ids: `add_special_tokens` as vLLM's
    /// completions default (true), so BOS comes from tokenizer.json's post-processor, or from
    /// `add_bos_token: true` in tokenizer_config.json when the post-processor adds none
    /// (transformers rebuilds the post-processor from that flag).
    pub fn prompt(&self, prompt: &str, add_special_tokens: bool) -> Result<Tokens, TokenizeError> {
        let mut tokens = self.text(prompt, add_special_tokens)?;
        if add_special_tokens {
            if let (Some(true), Some(bos)) = (self.config.add_bos_token, self.bos_id) {
                if tokens.ids.first() != Some(&bos) {
                    tokens.ids.insert(0, bos);
                    tokens.ids.truncate(self.limits.max_tokens);
                }
            }
            if let (Some(true), Some(eos), true) =
                (self.config.add_eos_token, self.eos_id, tokens.complete)
            {
                if tokens.ids.last() != Some(&eos) {
                    tokens.ids.push(eos);
                }
            }
        }
        Ok(tokens)
    }

    /// `text`'s leading token ids within the limits, cut where the ids are exact (module doc).
    pub fn text(&self, text: &str, add_special_tokens: bool) -> Result<Tokens, TokenizeError> {
        let end = self.cut(text);
        let cut = end < text.len();
        let encoding = self
            .tokenizer
            .encode_fast(&text[..end], add_special_tokens)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        let mut ids = encoding.get_ids().to_vec();
        if cut && add_special_tokens {
            // What the post-processor appends (an EOS) ends the whole prompt, not the cut.
            let mask = encoding.get_special_tokens_mask();
            while ids.len() > 1 && mask.get(ids.len() - 1) == Some(&1) {
                ids.pop();
            }
        }
        let complete = !cut && ids.len() <= self.limits.max_tokens;
        ids.truncate(self.limits.max_tokens);
        Ok(Tokens { ids, complete })
    }

    /// The byte offset `text` is tokenized up to: all of it within `max_bytes`, else the last
    /// safe cut at or before `max_bytes` (0 when there is none).
    pub fn cut(&self, text: &str) -> usize {
        let max = self.limits.max_bytes;
        if text.len() <= max {
            return text.len();
        }
        let occurrences = added_occurrences(text, &self.cut_tokens, max);
        let mut best = occurrences
            .iter()
            .map(|&(start, _)| start)
            .filter(|&start| start <= max)
            .max()
            .unwrap_or(0);
        if self.word_cuts {
            let bytes = text.as_bytes();
            // The last letter-space-letter point after `best` that no added token spans.
            let mut at = max.min(bytes.len().saturating_sub(1));
            while at > best {
                if at >= 1
                    && bytes[at] == b' '
                    && bytes[at - 1].is_ascii_alphabetic()
                    && bytes.get(at + 1).is_some_and(u8::is_ascii_alphabetic)
                    && !occurrences.iter().any(|&(s, e)| s < at && at < e)
                {
                    best = at;
                    break;
                }
                at -= 1;
            }
        }
        best
    }

    fn template(&self, tools: bool) -> Result<&ChatTemplate, TokenizeError> {
        let named = |name: &str| self.templates.iter().find(|(n, _)| n == name);
        (if tools { named("tool_use") } else { None })
            .or_else(|| named("default"))
            .or_else(|| self.templates.first())
            .map(|(_, template)| template)
            .ok_or_else(|| TokenizeError::NoTemplate {
                dir: self.dir.clone(),
            })
    }
}

fn at(index: usize, e: TokenizeError) -> TokenizeError {
    match e {
        TokenizeError::Body(detail) => TokenizeError::Body(format!("messages[{index}]: {detail}")),
        other => other,
    }
}

/// Where the added tokens `tokens` occur in `text[..limit + longest]`, as the tokenizer matches
/// them (leftmost, longest first at one start): (start, end) byte ranges, in order.
fn added_occurrences(text: &str, tokens: &[String], limit: usize) -> Vec<(usize, usize)> {
    let longest = tokens.iter().map(String::len).max().unwrap_or(0);
    let mut end = (limit + longest).min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let scope = &text[..end];
    let mut all: Vec<(usize, usize)> = tokens
        .iter()
        .flat_map(|t| {
            scope
                .match_indices(t.as_str())
                .map(|(s, m)| (s, s + m.len()))
        })
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
    let mut kept: Vec<(usize, usize)> = Vec::new();
    for (start, end) in all {
        if kept.last().is_none_or(|&(_, last_end)| start >= last_end) {
            kept.push((start, end));
        }
    }
    kept
}

/// Whether tokenizer.json's pipeline makes the letter-space-letter cut exact: a ByteLevel
/// pre-tokenizer with its GPT-2 regex, and no normalizer or one that leaves ASCII alone.
fn byte_level_words(tokenizer_json: &[u8]) -> bool {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(tokenizer_json) else {
        return false;
    };
    let kind = |v: &serde_json::Value| v.get("type").and_then(|t| t.as_str()).map(str::to_owned);
    let pre = &json["pre_tokenizer"];
    let byte_level = kind(pre).as_deref() == Some("ByteLevel")
        && pre.get("use_regex").and_then(|v| v.as_bool()) != Some(false)
        && pre.get("add_prefix_space").and_then(|v| v.as_bool()) != Some(true);
    let normalizer_ok = match &json["normalizer"] {
        serde_json::Value::Null => true,
        n => matches!(kind(n).as_deref(), Some("NFC" | "NFKC" | "NFD" | "NFKD")),
    };
    let bpe = kind(&json["model"]).as_deref() == Some("BPE");
    byte_level && normalizer_ok && bpe
}

/// One message as vLLM hands it to the template: role, content (a string, or a list of text
/// parts when the template walks parts), then `tool_calls` (arguments parsed), `tool_call_id`
/// and `name` when given. Keys are kept in that order (`tojson(message)` prints them).
fn message(m: &Value, wants_parts: bool) -> Result<Value, TokenizeError> {
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
fn final_content(m: &Value) -> Option<String> {
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
