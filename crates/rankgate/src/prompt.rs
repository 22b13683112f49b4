//! A request's prompt as prefix affinity compares it with what each rank holds: the chunk names
//! of its raw JSON (what rankgate recorded sending, [`crate::prefix`]) and, where the model's
//! tokenizer is configured (`[[models]]`) and `routing.kv_events` is on, its leading token ids
//! exactly as the engine computes them, which the ranks' KV-event indexes are keyed by.
//!
//! Tokenizers are loaded once at startup ([`Prompts::load`]; a missing or broken file is a
//! config error naming it). Tokenizing is best effort per request: a body the template refuses
//! or a model without a tokenizer routes by the record alone, never fails the request (the
//! engine says what is wrong with it).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use crate::config::ModelConfig;
use crate::scan::json_member_raw;
use crate::tokenize::{ChatTokenizer, TokenizeError, TokenizerFiles};

/// A request's prompt, read for affinity.
#[derive(Debug, Clone, Default)]
pub struct Prompt {
    /// Chunk names of the raw `messages` (or `prompt`) JSON; empty when none or too short.
    pub chunks: Vec<u64>,
    /// The engine's leading token ids for it, when tokenized.
    pub tokens: Option<Arc<Vec<u32>>>,
}

impl Prompt {
    /// Nothing to match: no chunk and no token.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty() && self.tokens.as_ref().is_none_or(|t| t.is_empty())
    }
}

/// A request's token ids, computed before the pick (`proxy::tokens`), carried in its
/// extensions (and to a retry's attempts).
#[derive(Debug, Clone)]
pub struct PromptTokens(pub Arc<Vec<u32>>);

/// A model's tokenizer could not be loaded.
#[derive(Debug, thiserror::Error)]
#[error("models[{index}].tokenizer ({model}): {source}")]
pub struct LoadError {
    pub index: usize,
    pub model: Arc<str>,
    pub source: TokenizeError,
}

/// The tokenizers of `[[models]]`, by model id, and the models whose engines tokenize.
#[derive(Debug, Default)]
pub struct Prompts {
    tokenizers: HashMap<Arc<str>, Arc<ChatTokenizer>>,
    /// `models[].engine_tokenize` without a tokenizer: an engine's `POST /tokenize` is asked.
    by_engine: Vec<Arc<str>>,
}

/// How a request's prompt gets its tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tokenizer {
    /// In-process, by its model's tokenizer.
    Here,
    /// By an engine serving this model (`POST /tokenize`).
    Engine(Arc<str>),
    /// Not at all: its model has neither.
    None,
}

impl Prompts {
    /// Loads every model's tokenizer; the first that fails is the error. Models that name
    /// only the engine's `/tokenize` load nothing here.
    pub fn load(models: &[ModelConfig]) -> Result<Prompts, LoadError> {
        let mut tokenizers = HashMap::new();
        let mut by_engine = Vec::new();
        for (index, m) in models.iter().enumerate() {
            let Some(path) = &m.tokenizer else {
                if m.engine_tokenize {
                    by_engine.push(m.name.clone());
                }
                continue;
            };
            let err = |source| LoadError {
                index,
                model: m.name.clone(),
                source,
            };
            let mut files = files(path).map_err(err)?;
            if let Some(t) = &m.chat_template {
                files.chat_template = Some(t.clone());
            }
            let tokenizer = ChatTokenizer::from_files(&files).map_err(err)?;
            tokenizers.insert(m.name.clone(), Arc::new(tokenizer));
        }
        Ok(Prompts {
            tokenizers,
            by_engine,
        })
    }

    /// Whether any model's prompts can be tokenized.
    pub fn any(&self) -> bool {
        !self.tokenizers.is_empty() || !self.by_engine.is_empty()
    }

    /// How the prompt of `body` gets its tokens.
    pub fn tokenizer(&self, body: &[u8]) -> Tokenizer {
        let model = match json_member_raw(body, &["model"]) {
            Ok(Some(raw)) => serde_json::from_slice::<&str>(raw).ok(),
            _ => None,
        };
        match model {
            Some(m) if self.tokenizers.contains_key(m) => Tokenizer::Here,
            Some(m) => match self.by_engine.iter().find(|e| ***e == *m) {
                Some(e) => Tokenizer::Engine(e.clone()),
                None => Tokenizer::None,
            },
            None if self.tokenizers.len() == 1 => Tokenizer::Here,
            None => Tokenizer::None,
        }
    }

    /// The body's leading token ids, by its model's tokenizer (the only one when the body
    /// names none, as the engine then serves its only model). `None` without a tokenizer or
    /// when the body does not tokenize.
    pub fn tokens(&self, body: &[u8]) -> Option<Vec<u32>> {
        let t = match json_member_raw(body, &["model"]).ok()? {
            Some(raw) => {
                let model: &str = serde_json::from_slice(raw).ok()?;
                self.tokenizers.get(model)?
            }
            None if self.tokenizers.len() == 1 => self.tokenizers.values().next()?,
            None => return None,
        };
        let chat = json_member_raw(body, &["messages"]).ok()?.is_some();
        let result = match chat {
            true => t.chat(body),
            false => t.completion(body),
        };
        match result {
            Ok(tokens) => Some(tokens.ids),
            Err(e) => {
                tracing::debug!(error = %e, "prompt not tokenized: affinity uses the record");
                None
            }
        }
    }
}

/// A model's files: a directory, or its `tokenizer.json` itself (with whatever config and
/// template sit beside it).
fn files(path: &Path) -> Result<TokenizerFiles, TokenizeError> {
    match path.is_dir() {
        true => TokenizerFiles::in_dir(path),
        false if !path.exists() => Err(TokenizeError::Read {
            path: path.to_path_buf(),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no such model directory or tokenizer.json",
            ),
        }),
        false => {
            let dir = path.parent().unwrap_or(Path::new("."));
            let mut files = TokenizerFiles::in_dir(dir)?;
            files.tokenizer = path.to_path_buf();
            Ok(files)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/vllm-0.32-kv-events")
    }

    fn model(name: &str, tokenizer: Option<std::path::PathBuf>) -> ModelConfig {
        ModelConfig {
            name: name.into(),
            tokenizer,
            chat_template: None,
            engine_tokenize: false,
        }
    }

    #[test]
    fn a_chat_body_reads_as_the_engines_tokens() {
        let p = Prompts::load(&[model("tiny-llama", Some(fixture_dir()))]).unwrap();
        let golden: serde_json::Value = serde_json::from_slice(
            &std::fs::read(fixture_dir().join("chat_tokenize_golden.json")).unwrap(),
        )
        .unwrap();
        let turn = &golden[0];
        let body = serde_json::json!({"model": "tiny-llama", "messages": turn["messages"]});
        let body = serde_json::to_vec(&body).unwrap();
        let want: Vec<u32> = serde_json::from_value(turn["tokenize"].clone()).unwrap();
        assert_eq!(p.tokens(&body), Some(want.clone()));
        // Another model, or garbage, has no tokens.
        let other = String::from_utf8(body.clone())
            .unwrap()
            .replace("tiny-llama", "other");
        assert_eq!(p.tokens(other.as_bytes()), None);
        assert_eq!(p.tokens(b"{\"messages\": 3"), None);
        // The only tokenizer serves a body that names no model.
        let unnamed = serde_json::json!({"messages": turn["messages"]});
        assert_eq!(p.tokens(&serde_json::to_vec(&unnamed).unwrap()), Some(want));
    }

    #[test]
    fn a_missing_tokenizer_names_the_model_and_the_file() {
        let e = Prompts::load(&[model("m", Some("/nonexistent/model".into()))]).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("models[0].tokenizer (m): /nonexistent/model:"),
            "{text}"
        );
        assert!(!Prompts::load(&[]).unwrap().any());
    }
}
