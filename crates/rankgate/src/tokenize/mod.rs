//! A request's prompt as the engine's token ids, computed in the router: the model's
//! `tokenizer.json` (Hugging Face `tokenizers`) and its chat template (Jinja, run by `minijinja`),
//! so that prefix-cache routing can hash the same token blocks the engine caches.
//!
//! What each file owns:
//! - [`files`]: finding and reading a model directory's tokenizer files (`tokenizer.json`,
//!   `tokenizer_config.json`, `chat_template.jinja`), errors naming the file.
//! - [`template`]: the Jinja environment Hugging Face templates expect (Python string methods,
//!   `raise_exception`, Python's `tojson`, `strftime_now`) and the render of one conversation.
//! - [`strftime`]: the date formats templates ask `strftime_now` for, without a date crate.
//! - [`chat`]: [`ChatTokenizer`]: a request body (chat `messages` or completions `prompt`) to
//!   token ids, as vLLM's OpenAI server tokenizes it, and the cap on what is tokenized.
//! - [`messages`]: the chat messages reshaped as vLLM hands them to the template.
//! - [`cut`]: where a text may be cut without changing the tokens before the cut.
//! - [`cache`]: the ids of prompt pieces already seen (a chat's earlier turns).
//! - [`error`]: [`TokenizeError`], one type for loading and tokenizing.
//! - [`engine`]: the opt-in fallback, the engine's own `POST /tokenize`, timed.
//!
//! Why a cap is safe: prefix routing only compares a prompt's leading blocks with what a rank
//! holds, so the first N tokens (exactly the engine's first N) are all it needs; a longer prompt
//! only under-counts a match that is longer than the cap. The cut is made where the engine's
//! tokens provably do not depend on the text after it (see [`chat`]), never by truncating
//! message text before the template runs.
//!
//! This module is a leaf: it imports nothing of the crate, so the KV index, the policy and the
//! simulator can all use it.

pub mod cache;
pub mod chat;
pub mod cut;
pub mod engine;
pub mod error;
pub mod files;
pub mod messages;
pub mod strftime;
pub mod template;

pub use chat::{ChatTokenizer, Limits, Tokens, DEFAULT_CACHE_BYTES};
pub use engine::{engine_tokenize, EngineTokens, TokenizeRequest};
pub use error::TokenizeError;
pub use files::TokenizerFiles;
