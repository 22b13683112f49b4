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
    /// `cfg` as rankgate starts with it (its admin token read at load), read from `path`.
    pub fn new(cfg: &Config, path: Option<PathBuf>, membership: Membership) -> Control {
        let token = (cfg.server.admin_token.as_ref()).map(|t| Keys::single(&t.0));
        Control {
            membership,
            started: cfg.clone(),
            path,
            token,
        }
    }

    /// Whether the admin API may name `var` as an engine's key: only variables the config
    /// file already names for one. Any other would let the admin token send any of the
    /// process's environment (the admin token itself included) to an address of its choosing.
    pub fn key_env_allowed(&self, var: &str) -> bool {
        self.started.key_vars.iter().any(|v| v == var)
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

/// The settings other than `[[engines]]` that differ between `a` and `b` (listed in the
/// config, where the settings are).
fn restart_needed(a: &Config, b: &Config) -> Vec<&'static str> {
    a.restart_needed(b)
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
        assert_eq!(restart_needed(&a, &c), ["server.max_in_flight"]);
    }
}
