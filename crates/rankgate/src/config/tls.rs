//! The TLS tables: `[server.tls]` (both front doors), `[server.admin_tls]` (the admin listener)
//! and `[engine_tls]` (how `https://` engines are reached). Only paths and names are checked
//! here; the files are read when rankgate starts (and by `rankgate check`), so an error names
//! the file and what is wrong with it.

use std::path::PathBuf;

use serde::Deserialize;

use super::error::{invalid, ConfigError};

/// A listener's certificate: the chain and its private key in PEM files, re-read on SIGHUP and
/// when either file changes.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTls {
    /// The certificate chain, leaf first (PEM).
    pub cert_file: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// When set, clients must present a certificate this CA (PEM, one or more) signed: mTLS.
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
}

/// `[engine_tls]`: trust and identity for `https://` engines (their OpenAI API, gRPC service,
/// telemetry and health). Cleartext `http://` engines are untouched by it.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineTls {
    /// CAs (PEM) that sign the engines' certificates; the system's roots when unset.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// rankgate's client certificate chain (PEM), for engines that require mTLS.
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// Its private key (PEM).
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// The name sent in SNI and checked against the engines' certificates, when engines are
    /// reached by an address their certificates do not name (pod IPs from discovery). By
    /// default each engine's URL host.
    #[serde(default)]
    pub server_name: Option<String>,
}

impl EngineTls {
    pub(super) fn validate(self) -> Result<EngineTls, ConfigError> {
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(invalid(
                "engine_tls",
                "cert_file and key_file go together: a client certificate needs its key",
            ));
        }
        if let Some(name) = &self.server_name {
            if rustls_pki_types::ServerName::try_from(name.as_str()).is_err() {
                return Err(invalid(
                    "engine_tls.server_name",
                    format!("{name:?} is neither a DNS name nor an IP address"),
                ));
            }
        }
        Ok(self)
    }
}
