//! The seam through which a real tokenizer (and chat template) names the simulated engine's KV
//! blocks: [`SimTokenizer`].

use std::sync::Arc;

use serde_json::Value;

/// A request's prompt ids and a text's ids, as the engine's tokenizer would give them: the seam
/// through which a real tokenizer (and chat template) names the sim's KV blocks, so that the
/// token ids its KV events carry are the ones a router computes for the same request.
#[derive(Clone)]
pub struct SimTokenizer {
    prompt: Arc<PromptIds>,
    text: Arc<TextIds>,
}

/// A request body's prompt token ids (the chat template applied for `messages`); `None` when
/// the request cannot be tokenized (the sim falls back to its stand-in).
pub type PromptIds = dyn Fn(&Value) -> Option<Vec<u32>> + Send + Sync;
/// Generated text's token ids, without special tokens.
pub type TextIds = dyn Fn(&str) -> Option<Vec<u32>> + Send + Sync;

impl SimTokenizer {
    pub fn new(
        prompt: impl Fn(&Value) -> Option<Vec<u32>> + Send + Sync + 'static,
        text: impl Fn(&str) -> Option<Vec<u32>> + Send + Sync + 'static,
    ) -> SimTokenizer {
        SimTokenizer {
            prompt: Arc::new(prompt),
            text: Arc::new(text),
        }
    }

    /// The prompt's token ids for a request body.
    pub fn prompt_ids(&self, body: &Value) -> Option<Vec<u32>> {
        (self.prompt)(body)
    }

    /// The token ids of generated text.
    pub fn text_ids(&self, text: &str) -> Option<Vec<u32>> {
        (self.text)(text)
    }
}

impl std::fmt::Debug for SimTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SimTokenizer")
    }
}
