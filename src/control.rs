//! Runtime control of the fleet: reloading the config file (SIGHUP, `POST /reload`), the admin
//! API's engine changes, and the token that guards them.
//!
//! Only `[[engines]]` take effect on reload; every other setting is fixed for the life of the
//! process (listeners are bound, pools sized, discovery tasks running), so a reload that changes
//! one applies the engines and names the settings that wait for a restart. A file that does not
//! parse or validate changes nothing.

use std::path::PathBuf;

use serde::Serialize;

use crate::config::{Config, ConfigError};
use crate::membership::{Change, Membership, MembershipError, Outcome};
use crate::proxy::{Denied, Keys};
use crate::worker::Origin;

/// Why a reload changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("rankgate was started without a config file: nothing to reload")]
    NoFile,
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Membership(#[from] MembershipError),
}

/// What a reload did.
#[derive(Debug, Serialize)]
pub struct Reloaded {
    #[serde(flatten)]
    pub outcome: Outcome,
    /// Settings that differ in the file but take effect only on restart.
    pub restart_needed: Vec<&'static str>,
}

/// Why the admin token could not be read at startup (names the variable, never a value).
#[derive(Debug, thiserror::Error)]
#[error("server.admin_token_env: environment variable {var} {problem}")]
pub struct TokenError {
    var: String,
    problem: &'static str,
}

/// Holds what runtime changes need: the membership handle, the config rankgate started with,
/// and the admin token.
pub struct Control {
    pub membership: Membership,
    /// The config as started (settings other than engines never change after).
    started: Config,
    path: Option<PathBuf>,
    token: Option<Keys>,
}

/// Why an admin mutation was refused before it was looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No `server.admin_token_env`: mutations are off (403).
    Disabled,
    /// Missing or wrong token (401).
    Denied(Denied),
}

impl Control {
    /// Reads the admin token named by `server.admin_token_env`: a variable that is named but
    /// unset or empty stops the start rather than leaving the admin API open or shut by surprise.
    pub fn new(
        cfg: &Config,
        path: Option<PathBuf>,
        membership: Membership,
    ) -> Result<Control, TokenError> {
        let token = match &cfg.server.admin_token_env {
            None => None,
            Some(var) => {
                let err = |problem| TokenError {
                    var: var.clone(),
                    problem,
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
                    return Err(err("must be printable ASCII without spaces"));
                }
                Some(Keys::single(value.as_bytes()))
            }
        };
        Ok(Control {
            membership,
            started: cfg.clone(),
            path,
            token,
        })
    }

    /// Whether a request may change the fleet (constant-time token comparison).
    pub fn authorize(&self, headers: &http::HeaderMap) -> Result<(), Refusal> {
        let token = self.token.as_ref().ok_or(Refusal::Disabled)?;
        token.check(headers).map_err(Refusal::Denied)
    }

    /// Re-reads the config file and applies its engines.
    pub async fn reload(&self) -> Result<Reloaded, ReloadError> {
        let path = self.path.as_ref().ok_or(ReloadError::NoFile)?;
        let cfg = Config::load(path)?;
        let restart_needed = restart_needed(&self.started, &cfg);
        let outcome = self
            .membership
            .apply(Change::Replace {
                origin: Origin::Config,
                engines: cfg.engines,
            })
            .await?;
        Ok(Reloaded {
            outcome,
            restart_needed,
        })
    }
}

/// The settings other than `[[engines]]` that differ between `a` and `b`.
fn restart_needed(a: &Config, b: &Config) -> Vec<&'static str> {
    let (sa, sb) = (&a.server, &b.server);
    let mut out = Vec::new();
    for (key, differs) in [
        ("server.listen", sa.listen != sb.listen),
        ("server.admin_listen", sa.admin_listen != sb.admin_listen),
        ("server.grpc_listen", sa.grpc_listen != sb.grpc_listen),
        ("server", sa != sb),
        ("routing", a.routing != b.routing),
        ("telemetry", a.telemetry != b.telemetry),
        ("discovery", a.discovery != b.discovery),
    ] {
        // `server` is named as a whole only when something beside its listeners changed.
        let listeners_only = key == "server" && {
            let mut c = sb.clone();
            (c.listen, c.admin_listen, c.grpc_listen) =
                (sa.listen, sa.admin_listen, sa.grpc_listen);
            c == *sa
        };
        if differs && !listeners_only {
            out.push(key);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reload_names_what_waits_for_a_restart() {
        let base = "[[engines]]\nurl = \"http://a:1\"\nflavor = \"vllm\"\n";
        let a = Config::from_str(base).unwrap();
        let same_but_engines =
            Config::from_str("[[engines]]\nurl = \"http://b:1\"\nflavor = \"vllm\"\n").unwrap();
        assert!(restart_needed(&a, &same_but_engines).is_empty());
        let b = Config::from_str(&format!(
            "[server]\nlisten = \"127.0.0.1:1234\"\n[routing]\npolicy = \"round_robin\"\n{base}"
        ))
        .unwrap();
        assert_eq!(restart_needed(&a, &b), ["server.listen", "routing"]);
        let c = Config::from_str(&format!("[server]\nmax_in_flight = 3\n{base}")).unwrap();
        assert_eq!(restart_needed(&a, &c), ["server"]);
    }
}
