//! TLS on both sides, with rustls and ring. Listeners: a certificate read from PEM files at
//! start, read again on SIGHUP and when a file changes, and served to every connection accepted
//! after that (connections already open keep the one they were made with); HTTP/1.1 and h2 by
//! ALPN; optionally client certificates (mTLS). Engines: `https://` URLs verified against the
//! system's roots or a CA file, SNI from the URL host (or one configured name), an optional
//! client certificate.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::config::{EngineTls, ListenerTls};

/// How often the listeners' certificate files are looked at for a change.
pub const WATCH_EVERY: Duration = Duration::from_secs(1);

/// ALPN for the listeners: h2 first, so clients that speak it get it.
const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// Why a certificate, key or CA could not be used. Names the config key and the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{key}: cannot read {}: {source}", path.display())]
    Read {
        key: String,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{key}: {}: {problem}", path.display())]
    File {
        key: String,
        path: PathBuf,
        problem: String,
    },
    #[error("{key}: {problem}")]
    Config { key: String, problem: String },
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(key: &str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        key: key.into(),
        path: path.into(),
        source,
    })
}

fn certs(key: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(key, path)?;
    let file = |problem: String| TlsError::File {
        key: key.into(),
        path: path.into(),
        problem,
    };
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file(format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(file("holds no PEM certificate (BEGIN CERTIFICATE)".into()));
    }
    Ok(certs)
}

fn private_key(key: &str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(key, path)?;
    let file = |problem: String| TlsError::File {
        key: key.into(),
        path: path.into(),
        problem,
    };
    // rustls reads no passphrase: say so rather than "no key found".
    let text = String::from_utf8_lossy(&pem);
    if text.contains("ENCRYPTED PRIVATE KEY") || text.contains("Proc-Type: 4,ENCRYPTED") {
        return Err(file(
            "holds a passphrase-protected key, which rankgate cannot read: store it unencrypted (e.g. `openssl pkey -in KEY -out KEY.plain`) with file permissions guarding it".into(),
        ));
    }
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
        file(format!(
            "holds no usable PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"
        ))
    })
}

fn roots(key: &str, path: &Path) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in certs(key, path)? {
        store.add(cert).map_err(|e| TlsError::File {
            key: key.into(),
            path: path.into(),
            problem: format!("a CA certificate rustls cannot use: {e}"),
        })?;
    }
    Ok(store)
}

/// A listener's TLS: the server config new connections are accepted with, swapped whole when
/// the files change.
#[derive(Debug)]
pub struct ServerTls {
    /// The config key, for messages: `server.tls` or `server.admin_tls`.
    key: &'static str,
    files: ListenerTls,
    current: ArcSwap<ServerConfig>,
    /// The files' modification times and sizes when last read, successfully or not: a change
    /// is read once, and a pair caught half-written is read again when the second file lands.
    seen: Mutex<Vec<Option<(SystemTime, u64)>>>,
}

impl ServerTls {
    /// Reads the files; an error here stops the start.
    pub fn load(key: &'static str, files: &ListenerTls) -> Result<Arc<ServerTls>, TlsError> {
        let seen = stamps(files);
        let config = server_config(key, files)?;
        Ok(Arc::new(ServerTls {
            key,
            files: files.clone(),
            current: ArcSwap::from_pointee(config),
            seen: Mutex::new(seen),
        }))
    }

    /// The acceptor for the next connection.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.current.load_full())
    }

    /// Reads the files again and serves what they hold from the next connection on. On an
    /// error the certificate in use stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let seen = stamps(&self.files);
        let result = server_config(self.key, &self.files);
        *self.seen.lock().unwrap_or_else(|p| p.into_inner()) = seen;
        self.current.store(Arc::new(result?));
        Ok(())
    }

    /// Whether a file changed since it was last read.
    fn changed(&self) -> bool {
        *self.seen.lock().unwrap_or_else(|p| p.into_inner()) != stamps(&self.files)
    }

    /// Reloads and logs the outcome.
    pub fn reload_logged(&self) {
        match self.reload() {
            Ok(()) => tracing::info!(
                key = self.key,
                cert_file = %self.files.cert_file.display(),
                "TLS certificate reloaded"
            ),
            Err(e) => {
                tracing::error!(error = %e, "TLS certificate not reloaded: the one in use stays")
            }
        }
    }
}

fn stamps(files: &ListenerTls) -> Vec<Option<(SystemTime, u64)>> {
    [Some(&files.cert_file), Some(&files.key_file)]
        .into_iter()
        .chain([files.client_ca_file.as_ref()])
        .flatten()
        .map(|p| {
            let m = std::fs::metadata(p).ok()?;
            Some((m.modified().ok()?, m.len()))
        })
        .collect()
}

fn server_config(key: &str, files: &ListenerTls) -> Result<ServerConfig, TlsError> {
    let chain = certs(&format!("{key}.cert_file"), &files.cert_file)?;
    let private = private_key(&format!("{key}.key_file"), &files.key_file)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config {
            key: key.into(),
            problem: e.to_string(),
        })?;
    let builder = match &files.client_ca_file {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let at = format!("{key}.client_ca_file");
            let verifier = WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots(&at, path)?),
                provider(),
            )
            .build()
            .map_err(|e| TlsError::File {
                key: at,
                path: path.clone(),
                problem: e.to_string(),
            })?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, private)
        .map_err(|e| TlsError::File {
            key: format!("{key}.key_file"),
            path: files.key_file.clone(),
            problem: format!("does not go with {}: {e}", files.cert_file.display()),
        })?;
    config.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// Looks at the listeners' certificate files every [`WATCH_EVERY`] and reloads those that
/// changed, until `stop` resolves.
pub async fn watch(listeners: Vec<Arc<ServerTls>>, stop: impl std::future::Future<Output = ()>) {
    if listeners.is_empty() {
        return;
    }
    let mut stop = std::pin::pin!(stop);
    let mut tick = tokio::time::interval(WATCH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = &mut stop => return,
        }
        for tls in &listeners {
            if tls.changed() {
                tls.reload_logged();
            }
        }
    }
}

/// The client side for `https://` engines: the rustls config and the SNI name, if one is set.
#[derive(Debug, Clone)]
pub struct Upstream {
    pub config: Arc<ClientConfig>,
    pub server_name: Option<ServerName<'static>>,
}

impl Upstream {
    /// From `[engine_tls]`: its CA file or the system's roots, its client certificate if any.
    pub fn load(cfg: &EngineTls) -> Result<Upstream, TlsError> {
        if *cfg == EngineTls::default() {
            // The system's roots, read once per process however many clients use them.
            return Ok(Upstream::system().clone());
        }
        let roots = match &cfg.ca_file {
            Some(path) => roots("engine_tls.ca_file", path)?,
            None => system_roots(),
        };
        Upstream::with_roots(roots, cfg)
    }

    /// The system's roots and no client certificate, read once per process: for clients of
    /// public or system-trusted servers (the tools, the OTLP exporter).
    pub fn system() -> &'static Upstream {
        static SYSTEM: std::sync::OnceLock<Upstream> = std::sync::OnceLock::new();
        SYSTEM.get_or_init(|| {
            Upstream::with_roots(system_roots(), &EngineTls::default())
                .expect("a client config without files cannot fail")
        })
    }

    /// A client that trusts only `ca_file` (or the system's roots) and presents no certificate:
    /// for the tools (`top`, the load client) reaching a TLS listener of rankgate's.
    pub fn trusting(ca_file: Option<&Path>) -> Result<Upstream, TlsError> {
        Upstream::load(&EngineTls {
            ca_file: ca_file.map(Into::into),
            ..EngineTls::default()
        })
    }

    fn with_roots(roots: RootCertStore, cfg: &EngineTls) -> Result<Upstream, TlsError> {
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config {
                key: "engine_tls".into(),
                problem: e.to_string(),
            })?
            .with_root_certificates(roots);
        let config = match (&cfg.cert_file, &cfg.key_file) {
            (Some(cert), Some(key)) => builder
                .with_client_auth_cert(
                    certs("engine_tls.cert_file", cert)?,
                    private_key("engine_tls.key_file", key)?,
                )
                .map_err(|e| TlsError::File {
                    key: "engine_tls.key_file".into(),
                    path: key.clone(),
                    problem: format!("does not go with {}: {e}", cert.display()),
                })?,
            _ => builder.with_no_client_auth(),
        };
        let server_name = match &cfg.server_name {
            Some(name) => {
                Some(
                    ServerName::try_from(name.clone()).map_err(|e| TlsError::Config {
                        key: "engine_tls.server_name".into(),
                        problem: format!("{name:?}: {e}"),
                    })?,
                )
            }
            None => None,
        };
        Ok(Upstream {
            config: Arc::new(config),
            server_name,
        })
    }
}

/// The system's trusted roots. None found is not an error here: only an `https://` engine needs
/// them, and its connections then fail naming the unknown issuer.
fn system_roots() -> RootCertStore {
    let found = rustls_native_certs::load_native_certs();
    for e in &found.errors {
        tracing::debug!(error = %e, "reading the system's CA certificates");
    }
    let mut store = RootCertStore::empty();
    let (added, ignored) = store.add_parsable_certificates(found.certs);
    tracing::debug!(added, ignored, "system CA certificates");
    store
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rankgate-tls-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn errors_name_the_key_and_the_file() {
        let dir = scratch("errors");
        let cert = dir.join("cert.pem");
        let key = dir.join("key.pem");
        std::fs::write(&cert, "not pem at all").unwrap();
        std::fs::write(&key, "").unwrap();
        let files = ListenerTls {
            cert_file: cert.clone(),
            key_file: key.clone(),
            client_ca_file: None,
        };
        let e = ServerTls::load("server.tls", &files)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("server.tls.cert_file:"), "{e}");
        assert!(
            e.contains("cert.pem") && e.contains("no PEM certificate"),
            "{e}"
        );

        let missing = ListenerTls {
            cert_file: dir.join("absent.pem"),
            ..files
        };
        let e = ServerTls::load("server.admin_tls", &missing)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("server.admin_tls.cert_file") && e.contains("absent.pem"),
            "{e}"
        );
        let e = Upstream::trusting(Some(&dir.join("no-ca.pem")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("engine_tls.ca_file") && e.contains("no-ca.pem"),
            "{e}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
