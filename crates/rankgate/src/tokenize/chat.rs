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
//! The cap ([`Limits`]): the rendered text is cut before tokenizing at the last exact cut
//! ([`super::cut`]) within `max_bytes`, so the ids returned are exactly the engine's first
//! ones, then at `max_tokens`. With a byte-level tokenizer the text is tokenized in pieces
//! between exact cuts, each looked up in [`super::cache`] first: a chat's next turn repeats
//! the conversation so far, and only its new pieces are tokenized.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use minijinja::Value;
use serde::Deserialize;

use super::cache::{ChunkCache, CHUNK_BYTES};
use super::cut::Cuts;
use super::error::TokenizeError;
use super::files::{self, Config, TokenizerFiles};
use super::messages::{at, final_content, message};
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

/// The piece cache's default bound: ~300 conversations of 32k tokens (~200 KB each here).
pub const DEFAULT_CACHE_BYTES: usize = 64 * 1024 * 1024;

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
    /// Where the text may be cut exactly (the cap, the cache's pieces).
    cuts: Cuts,
    /// Pieces of prompts already tokenized; only where pieces are exact (byte-level BPE).
    cache: Option<ChunkCache>,
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
        let cuts = Cuts::new(&tokenizer, &bytes);
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
        let id = |name: &str| config.special(name).and_then(|t| tokenizer.token_to_id(t));
        Ok(ChatTokenizer {
            bos_id: id("bos_token"),
            eos_id: id("eos_token"),
            tokenizer,
            templates,
            config,
            cache: cuts.words.then(|| ChunkCache::new(DEFAULT_CACHE_BYTES)),
            cuts,
            limits: Limits::DEFAULT,
            dir: files.dir(),
        })
    }

    /// The same tokenizer with other limits.
    pub fn with_limits(mut self, limits: Limits) -> ChatTokenizer {
        self.limits = limits;
        self
    }

    /// The same tokenizer with a piece cache of at most `max_bytes` (0: none). Only
    /// tokenizers whose pieces are exact (byte-level BPE) keep one; others ignore this.
    pub fn with_cache(mut self, max_bytes: usize) -> ChatTokenizer {
        self.cache = (self.cuts.words && max_bytes > 0).then(|| ChunkCache::new(max_bytes));
        self
    }

    /// Empties the piece cache.
    pub fn clear_cache(&self) {
        if let Some(cache) = &self.cache {
            cache.clear();
        }
    }

    /// The piece cache's (hits, misses, bytes held), if there is one.
    pub fn cache_stats(&self) -> Option<(u64, u64, usize)> {
        self.cache.as_ref().map(ChunkCache::stats)
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
        let head = &text[..end];
        let mut ids = match &self.cache {
            // The post-processor's tokens belong to the whole text, not to a piece: pieces
            // only without them (chat's default).
            Some(cache) if !add_special_tokens => self.pieces(cache, head)?,
            _ => {
                let encoding = self
                    .tokenizer
                    .encode_fast(head, add_special_tokens)
                    .map_err(|e| TokenizeError::Encode(e.to_string()))?;
                let mut ids = encoding.get_ids().to_vec();
                if cut && add_special_tokens {
                    // What the post-processor appends (an EOS) ends the whole prompt, not
                    // the cut.
                    let mask = encoding.get_special_tokens_mask();
                    while ids.len() > 1 && mask.get(ids.len() - 1) == Some(&1) {
                        ids.pop();
                    }
                }
                ids
            }
        };
        let complete = !cut && ids.len() <= self.limits.max_tokens;
        ids.truncate(self.limits.max_tokens);
        Ok(Tokens { ids, complete })
    }

    /// `text`'s ids piece by piece (pieces cut exactly, [`Cuts::chunks`]), each from the
    /// cache or tokenized and cached; stops once `max_tokens` are had.
    fn pieces(&self, cache: &ChunkCache, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let mut ids = Vec::new();
        let mut from = 0;
        let ends = self.cuts.chunks(text, CHUNK_BYTES);
        for end in ends.into_iter().chain(std::iter::once(text.len())) {
            let piece = &text[from..end];
            from = end;
            match cache.get(piece) {
                Some(hit) => ids.extend_from_slice(&hit),
                None => {
                    let encoding = self
                        .tokenizer
                        .encode_fast(piece, false)
                        .map_err(|e| TokenizeError::Encode(e.to_string()))?;
                    let piece_ids: Arc<[u32]> = Arc::from(encoding.get_ids());
                    ids.extend_from_slice(&piece_ids);
                    cache.put(piece, piece_ids);
                }
            }
            if ids.len() >= self.limits.max_tokens {
                break;
            }
        }
        Ok(ids)
    }

    /// The byte offset `text` is tokenized up to: all of it within `max_bytes`, else the last
    /// exact cut at or before `max_bytes` (0 when there is none).
    pub fn cut(&self, text: &str) -> usize {
        self.cuts.cut(text, self.limits.max_bytes)
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

#[cfg(test)]
mod tests;
