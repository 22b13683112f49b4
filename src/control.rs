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

/// The settings other than `[[engines]]` that differ between `a` and `b`.
fn restart_needed(a: &Config, b: &Config) -> Vec<&'static str> {
    let (sa, sb) = (&a.server, &b.server);
    let mut out: Vec<&'static str> = [
        ("server.listen", sa.listen != sb.listen),
        ("server.admin_listen", sa.admin_listen != sb.admin_listen),
        ("server.grpc_listen", sa.grpc_listen != sb.grpc_listen),
        (
            "server.max_body_bytes",
            sa.max_body_bytes != sb.max_body_bytes,
        ),
        (
            "server.connect_timeout",
            sa.connect_timeout != sb.connect_timeout,
        ),
        (
            "server.response_timeout",
            sa.response_timeout != sb.response_timeout,
        ),
        (
            "server.stream_idle_timeout",
            sa.stream_idle_timeout != sb.stream_idle_timeout,
        ),
        (
            "server.header_read_timeout",
            sa.header_read_timeout != sb.header_read_timeout,
        ),
        (
            "server.body_read_timeout",
            sa.body_read_timeout != sb.body_read_timeout,
        ),
        ("server.idle_timeout", sa.idle_timeout != sb.idle_timeout),
        (
            "server.h2_keepalive_interval",
            sa.h2_keepalive_interval != sb.h2_keepalive_interval,
        ),
        (
            "server.max_header_bytes",
            sa.max_header_bytes != sb.max_header_bytes,
        ),
        (
            "server.max_connections",
            sa.max_connections != sb.max_connections,
        ),
        (
            "server.max_engine_connections",
            sa.max_engine_connections != sb.max_engine_connections,
        ),
        (
            "server.grpc_streams_per_connection",
            sa.grpc_streams_per_connection != sb.grpc_streams_per_connection,
        ),
        ("server.max_in_flight", sa.max_in_flight != sb.max_in_flight),
        (
            "server.shutdown_delay",
            sa.shutdown_delay != sb.shutdown_delay,
        ),
        ("server.drain_grace", sa.drain_grace != sb.drain_grace),
        ("server.extra_routes", sa.extra_routes != sb.extra_routes),
        ("server.api_keys_env", sa.api_keys_env != sb.api_keys_env),
        ("server.api_keys_file", sa.api_keys_file != sb.api_keys_file),
        (
            "server.cors_allow_origins",
            sa.cors_allow_origins != sb.cors_allow_origins,
        ),
        (
            "server.admin_token_env",
            sa.admin_token_env != sb.admin_token_env,
        ),
        ("server.access_log", sa.access_log != sb.access_log),
        (
            "server.thread_per_core",
            sa.thread_per_core != sb.thread_per_core,
        ),
        // The files' contents reload on their own (SIGHUP, a change on disk); other paths do not.
        ("server.tls", sa.tls != sb.tls),
        ("server.admin_tls", sa.admin_tls != sb.admin_tls),
        ("engine_tls", a.engine_tls != b.engine_tls),
        ("routing", a.routing != b.routing),
        ("telemetry", a.telemetry != b.telemetry),
        ("discovery", a.discovery != b.discovery),
        ("tracing", a.tracing != b.tracing),
    ]
    .into_iter()
    .filter_map(|(key, differs)| differs.then_some(key))
    .collect();
    // A server key this list does not name still says so.
    if sa != sb && !out.iter().any(|k| k.starts_with("server.")) {
        out.push("server");
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
        assert_eq!(restart_needed(&a, &c), ["server.max_in_flight"]);
    }
}
