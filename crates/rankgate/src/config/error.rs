//! The one config error type, and `invalid`, with which every rule names the key at fault.

/// A config error: names the file, the key and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: cannot read: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: String, message: String },
    #[error("config file {path}: key `{key}`: {problem}")]
    Invalid {
        path: String,
        key: String,
        problem: String,
    },
}

impl ConfigError {
    /// The error without the file it is in: `key: problem` (for a request's errors, not a
    /// file's).
    pub fn problem(&self) -> String {
        match self {
            ConfigError::Invalid { key, problem, .. } => format!("{key}: {problem}"),
            e => e.to_string(),
        }
    }

    pub(super) fn with_path(self, p: &str) -> ConfigError {
        match self {
            ConfigError::Read { source, .. } => ConfigError::Read {
                path: p.into(),
                source,
            },
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: p.into(),
                message,
            },
            ConfigError::Invalid { key, problem, .. } => ConfigError::Invalid {
                path: p.into(),
                key,
                problem,
            },
        }
    }
}

pub(crate) fn invalid(key: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        path: String::new(),
        key: key.into(),
        problem: problem.into(),
    }
}
