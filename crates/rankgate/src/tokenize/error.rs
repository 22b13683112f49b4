//! [`TokenizeError`]: what went wrong loading a model's tokenizer files or tokenizing a request.
//! Its own file so that every file of the module imports it without importing the module root
//! (which re-exports them all).

use std::path::PathBuf;

/// What went wrong loading a tokenizer or tokenizing a request. Load errors name the file and
/// what is wrong with it; request errors say what in the body or template failed.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// `tokenizer.json` is not one the `tokenizers` crate can load.
    #[error("{}: not a tokenizer this build can load: {detail}", path.display())]
    Tokenizer { path: PathBuf, detail: String },
    /// `tokenizer_config.json` is not JSON or a field has the wrong shape.
    #[error("{}: {detail}", path.display())]
    Config { path: PathBuf, detail: String },
    /// Neither a `chat_template.jinja` nor a `chat_template` in the config: the model has no
    /// chat template, so chat requests cannot be tokenized here.
    #[error("no chat template in {}: neither chat_template.jinja nor a chat_template in tokenizer_config.json", dir.display())]
    NoTemplate { dir: PathBuf },
    /// The chat template does not compile.
    #[error("chat template {origin}: {detail}")]
    Template { origin: String, detail: String },
    /// The template called `raise_exception` for this conversation (e.g. roles that do not
    /// alternate): the engine would refuse the request too.
    #[error("chat template {origin} refused the conversation: {message}")]
    Raised { origin: String, message: String },
    /// The template failed on this conversation for another reason.
    #[error("chat template {origin} failed on this request: {detail}")]
    Render { origin: String, detail: String },
    /// The request body is not what the endpoint takes (not JSON, no `messages`, ...).
    #[error("request body: {0}")]
    Body(String),
    /// The engine's `/tokenize` failed or answered something else than tokens.
    #[error("{uri}: {detail}")]
    Engine { uri: String, detail: String },
    /// The tokenizer failed on the text (should not happen for valid UTF-8).
    #[error("tokenizer: {0}")]
    Encode(String),
}
