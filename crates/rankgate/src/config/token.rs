//! The admin token (`server.admin_token_env`): read from the environment once, checked so that
//! a `Bearer` header can carry it, and never shown (its Debug, its errors).

use super::error::{invalid, ConfigError};

/// The admin token. Its Debug never shows it.
#[derive(Clone, PartialEq)]
pub struct AdminToken(pub Box<[u8]>);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

/// The token in `var`: printable ASCII without spaces, so a `Bearer` header can carry it. The
/// error names the variable, never a value.
pub(super) fn admin_token(var: &str) -> Result<AdminToken, ConfigError> {
    let err = |problem: &str| {
        invalid(
            "server.admin_token_env",
            format!("environment variable {var:?} {problem}"),
        )
    };
    let value = std::env::var(var).map_err(|e| match e {
        std::env::VarError::NotPresent => err("is not set"),
        std::env::VarError::NotUnicode(_) => err("is not valid UTF-8"),
    })?;
    let value = value.trim();
    if value.is_empty() {
        return Err(err("is empty"));
    }
    if !value.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(err("must hold printable ASCII without spaces"));
    }
    Ok(AdminToken(value.as_bytes().into()))
}
