//! Runtime control of the fleet: reloading the config file (SIGHUP, `POST /reload`), the admin
//! API's engine changes, and the token that guards them.
//!
//! Only `[[engines]]` and `[[routes]]` take effect on reload (both in one snapshot); every other
//! setting is fixed for the life of the process (listeners are bound, pools sized, discovery
//! tasks running), so a reload that changes one applies the engines and routes and names the
//! settings that wait for a restart. A file that does not
//! parse or validate changes nothing.
//!
//! A reload reads and parses on a blocking thread, never on the runtime that serves and
//! publishes telemetry: a large file costs that thread, not a stale rank. The file is bounded
//! in size and kind (`config::read`), the read, parse and validation in time
//! ([`RELOAD_DEADLINE`]), and one reload runs at a time: another asked for meanwhile is
//! answered busy at once rather than queued behind it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::Semaphore;

use crate::config::{Config, ConfigError};
use crate::membership::{Change, Membership, MembershipError, Outcome};
use crate::proxy::{Denied, Keys};

/// Why a reload changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("rankgate was started without a config file: nothing to reload")]
    NoFile,
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Membership(#[from] MembershipError),
    #[error("another reload is running: try again when it has finished")]
    Busy,
    #[error("config file {path}: not read, parsed and validated within {}s: the fleet is unchanged", RELOAD_DEADLINE.as_secs())]
    Deadline { path: String },
    #[error("config file {path}: the reload's reader stopped: {problem}")]
    Reader { path: String, problem: String },
}

/// How long a reload may take to read, parse and validate the file. A file within
/// `config::MAX_CONFIG_BYTES` takes well under a second; past this the reload fails, and its
/// thread finishes on its own (the file is bounded, so it does) while the next reload waits
/// for it as for any running reload.
pub const RELOAD_DEADLINE: Duration = Duration::from_secs(10);

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
    /// One permit: held by the running reload, its blocking reader included.
    reloading: Arc<Semaphore>,
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
            reloading: Arc::new(Semaphore::new(1)),
        }
    }

    /// Whether the admin API may name `var` as an engine's key: only variables the config
    /// file already names for one. Any other would let the admin token send any of the
    /// process's environment (the admin token itself included) to an address of its choosing.
    pub fn key_env_allowed(&self, var: &str) -> bool {
        self.started.key_vars.iter().any(|v| v == var)
    }

    /// `routing.kv_events` as started (fixed for the life of the process): whether any rank's
    /// KV events are read at all, for `/workers`.
    pub fn kv_events(&self) -> bool {
        self.started.routing.kv_events
    }

    /// Whether a request may change the fleet (constant-time token comparison).
    pub fn authorize(&self, headers: &http::HeaderMap) -> Result<(), Refusal> {
        let token = self.token.as_ref().ok_or(Refusal::Disabled)?;
        token.check(headers).map(drop).map_err(Refusal::Denied)
    }

    /// Re-reads the config file (off the runtime, within [`RELOAD_DEADLINE`]) and applies its
    /// engines and routes; [`ReloadError::Busy`] while another reload runs.
    pub async fn reload(&self) -> Result<Reloaded, ReloadError> {
        let path = self.path.clone().ok_or(ReloadError::NoFile)?;
        let permit = (self.reloading.clone().try_acquire_owned()).map_err(|_| ReloadError::Busy)?;
        // The reader holds the permit too: a reader past the deadline keeps later reloads
        // busy until it ends, so no two ever run at once.
        let permit = Arc::new(permit);
        let held = permit.clone();
        let shown = path.display().to_string();
        let read = tokio::task::spawn_blocking(move || {
            let _held = held;
            Config::load(&path)
        });
        let cfg = match tokio::time::timeout(RELOAD_DEADLINE, read).await {
            Err(_) => return Err(ReloadError::Deadline { path: shown }),
            Ok(Err(e)) => {
                return Err(ReloadError::Reader {
                    path: shown,
                    problem: e.to_string(),
                })
            }
            Ok(Ok(cfg)) => cfg?,
        };
        let restart_needed = restart_needed(&self.started, &cfg);
        let outcome = self
            .membership
            .apply(Change::Reload {
                engines: cfg.engines,
                routes: cfg.routes,
            })
            .await?;
        drop(permit);
        Ok(Reloaded {
            outcome,
            restart_needed,
        })
    }
}

/// The settings other than `[[engines]]` and `[[routes]]` that differ between `a` and `b` (listed in the
/// config, where the settings are).
fn restart_needed(a: &Config, b: &Config) -> Vec<&'static str> {
    a.restart_needed(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_reload_while_one_runs_is_answered_busy() {
        let text = "[[engines]]\nurl = \"http://a:1\"\nflavor = \"vllm\"\n";
        let path = std::env::temp_dir().join(format!("rankgate-busy-{}.toml", std::process::id()));
        std::fs::write(&path, text).unwrap();
        let (membership, changes) = Membership::channel();
        let control = Control::new(
            &Config::from_str(text).unwrap(),
            Some(path.clone()),
            membership,
        );
        // The running reload's permit, as its reader holds it.
        let running = control.reloading.clone().try_acquire_owned().unwrap();
        assert!(matches!(control.reload().await, Err(ReloadError::Busy)));
        drop(running);
        // Free again: this one reads the file and waits for the publisher (none here).
        drop(changes);
        assert!(matches!(
            control.reload().await,
            Err(ReloadError::Membership(MembershipError::Stopped))
        ));
        let _ = std::fs::remove_file(&path);
    }

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
