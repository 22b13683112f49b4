//! Why a declared adapter could not be made to serve, as operators and clients are told it.

use std::time::Duration;

use http::StatusCode;

/// How long a server whose load of an adapter failed is not asked to load it again, and how
/// long a load done counts as the adapter's newest use there.
pub const FAILED_FOR: Duration = Duration::from_secs(30);

/// Why a declared adapter could not be made to serve.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LoadError {
    #[error("the LoRA adapter `{adapter}` ([[adapters]]) has base model `{base}`, which no vLLM server of this fleet serves now: it cannot be loaded anywhere")]
    NoServer { adapter: String, base: String },
    #[error("loading the LoRA adapter `{adapter}` on {server} failed: {why}; rankgate does not ask that server to load it again for {} s", FAILED_FOR.as_secs())]
    Failed {
        adapter: String,
        server: String,
        why: String,
    },
    #[error("every server of base model `{base}` holds its engines[].max_adapters adapters, each in use or not declared: the LoRA adapter `{adapter}` was not loaded; retry once one is idle")]
    Full { adapter: String, base: String },
    #[error("every load rankgate runs at once stayed busy for {} s, and the LoRA adapter `{adapter}` was not loaded; retry later", super::calls::LOAD_WITHIN.as_secs())]
    Busy { adapter: String },
    #[error("{server} said it loaded the LoRA adapter `{adapter}`, but its /v1/models does not list it; rankgate does not ask that server to load it again for {} s", FAILED_FOR.as_secs())]
    NotListed { adapter: String, server: String },
}

impl LoadError {
    /// What a client told nothing of the fleet may read: no server, no engine reply.
    pub fn write_public(&self, out: &mut String) -> std::fmt::Result {
        use std::fmt::Write;
        match self {
            LoadError::NoServer { adapter, .. } => {
                write!(out, "the LoRA adapter `{adapter}` cannot be loaded: no server serves its base model now")
            }
            LoadError::Failed { adapter, .. } => write!(
                out,
                "loading the LoRA adapter `{adapter}` failed; not tried again for {} s",
                FAILED_FOR.as_secs()
            ),
            LoadError::Full { adapter, .. } => write!(
                out,
                "the LoRA adapter `{adapter}` was not loaded: every server holds its limit of adapters in use; retry later"
            ),
            LoadError::Busy { adapter } => write!(
                out,
                "the LoRA adapter `{adapter}` waited too long for its load to start; retry later"
            ),
            LoadError::NotListed { adapter, .. } => write!(
                out,
                "the LoRA adapter `{adapter}` was loaded but is not listed; retry later"
            ),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            LoadError::Failed { .. } => StatusCode::BAD_GATEWAY,
            _ => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}
