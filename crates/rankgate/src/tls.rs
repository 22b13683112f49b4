//! TLS on both sides, with rustls and ring. Listeners: a certificate read from PEM files at
//! start, read again on SIGHUP and when a file changes, and served to every connection accepted
//! after that (connections already open keep the one they were made with); HTTP/1.1 and h2 by
//! ALPN; optionally client certificates (mTLS). Engines: `https://` URLs verified against the
//! system's roots or a CA file, SNI from the URL host (or one configured name), an optional
//! client certificate.
//!
//! A listener's certificate is watched for its end: one that has expired or expires within
//! [`EXPIRY_WARNING`] is warned of when it is read (start, `rankgate check`, each reload), and
//! its `notAfter` is on `/metrics` for an alert that does not wait for a reload. A CA
//! certificate served as a server's own (`openssl req -x509` makes one by default) is the
//! commonest self-made mistake, and rustls names it only by a variant name, so
//! [`advice`] turns that name into what to do wherever a TLS error is shown.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
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

/// A listener's certificate that expires within this is warned of.
pub const EXPIRY_WARNING: Duration = Duration::from_secs(14 * 24 * 3600);

/// What to do when a server presents a CA certificate as its own: rustls says only
/// `CaUsedAsEndEntity`.
pub const CA_AS_SERVER_ADVICE: &str = "this certificate is a CA (CA:TRUE, as `openssl req -x509` makes by default); give the CA that signed the server's certificate as the trust root, and serve a certificate that CA signed (CA:FALSE, with the server's names): README \"TLS certificates with openssl\" shows how";

/// Advice for a TLS error's text, when rustls's words alone do not say what to do.
pub fn advice(error_text: &str) -> Option<&'static str> {
    error_text
        .contains("CaUsedAsEndEntity")
        .then_some(CA_AS_SERVER_ADVICE)
}

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

/// The largest certificate, key or CA file read: a PEM bundle of a few hundred certificates.
pub const MAX_PEM_BYTES: u64 = 1 << 20;

/// A TLS file, read as the config is: a regular file of bounded size, so a path swapped for a
/// FIFO or a device cannot wedge a reload (SIGHUP, the file watch).
fn read(key: &str, path: &Path) -> Result<Vec<u8>, TlsError> {
    crate::config::read_regular(path, MAX_PEM_BYTES, "a TLS file").map_err(|source| {
        TlsError::Read {
            key: key.into(),
            path: path.into(),
            source,
        }
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
    /// The served certificate's `notAfter` (seconds since the epoch); `i64::MIN`: unknown.
    not_after: AtomicI64,
}

impl ServerTls {
    /// Reads the files; an error here stops the start.
    pub fn load(key: &'static str, files: &ListenerTls) -> Result<Arc<ServerTls>, TlsError> {
        let seen = stamps(files);
        let (config, not_after) = server_config(key, files)?;
        let tls = Arc::new(ServerTls {
            key,
            files: files.clone(),
            current: ArcSwap::from_pointee(config),
            seen: Mutex::new(seen),
            not_after: AtomicI64::new(not_after.unwrap_or(i64::MIN)),
        });
        tls.warn_expiry();
        Ok(tls)
    }

    /// The config key: `server.tls` or `server.admin_tls`.
    pub fn key(&self) -> &'static str {
        self.key
    }

    /// When the served certificate expires, in seconds since the epoch (unknown if its DER
    /// could not be read for it).
    pub fn not_after(&self) -> Option<i64> {
        Some(self.not_after.load(Ordering::Relaxed)).filter(|&t| t != i64::MIN)
    }

    /// The warning for a certificate that has expired or expires within [`EXPIRY_WARNING`].
    pub fn expiry_warning(&self) -> Option<String> {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64);
        expiry_warning(self.key, &self.files.cert_file, self.not_after()?, now)
    }

    fn warn_expiry(&self) {
        if let Some(w) = self.expiry_warning() {
            tracing::warn!("{w}");
        }
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
        let (config, not_after) = result?;
        self.current.store(Arc::new(config));
        (self.not_after).store(not_after.unwrap_or(i64::MIN), Ordering::Relaxed);
        self.warn_expiry();
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

/// The warning for a certificate at `path` that ends at `not_after`, seen at `now` (both in
/// seconds since the epoch), if it has ended or ends within [`EXPIRY_WARNING`].
fn expiry_warning(key: &str, path: &Path, not_after: i64, now: i64) -> Option<String> {
    let left = not_after - now;
    if left > EXPIRY_WARNING.as_secs() as i64 {
        return None;
    }
    let at = crate::x509::utc_text(not_after);
    let file = format!("{key}.cert_file {}", path.display());
    let renew = "renew it: the file is read again when it changes, and on SIGHUP";
    Some(if left <= 0 {
        format!(
            "{file}: the certificate EXPIRED at {at} ({} days ago), and clients refuse it: {renew}",
            -left / 86_400
        )
    } else if left < 86_400 {
        format!("{file}: the certificate expires at {at}, in less than a day: {renew}")
    } else {
        format!(
            "{file}: the certificate expires at {at}, in {} days: {renew}",
            left / 86_400
        )
    })
}

/// The server config, and its certificate's `notAfter` if its DER could be read for it.
fn server_config(key: &str, files: &ListenerTls) -> Result<(ServerConfig, Option<i64>), TlsError> {
    let chain = certs(&format!("{key}.cert_file"), &files.cert_file)?;
    let not_after = chain.first().and_then(|c| crate::x509::not_after(c));
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
    Ok((config, not_after))
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

    #[test]
    fn a_certificate_near_its_end_is_warned_of() {
        let path = Path::new("/etc/rankgate/cert.pem");
        let day = 86_400;
        let warn = |left: i64| expiry_warning("server.tls", path, 1_000 * day + left, 1_000 * day);
        assert_eq!(warn(15 * day), None);
        let w = warn(14 * day).unwrap();
        assert!(w.starts_with("server.tls.cert_file /etc/rankgate/cert.pem: the certificate expires at 1972-10-11 00:00:00 UTC"), "{w}");
        assert!(w.contains("in 14 days"), "{w}");
        assert!(warn(3600).unwrap().contains("in less than a day"));
        let w = warn(-3 * day).unwrap();
        assert!(
            w.contains("EXPIRED at") && w.contains("(3 days ago)"),
            "{w}"
        );
        let text = "invalid peer certificate: Other(OtherError(CaUsedAsEndEntity))";
        assert_eq!(advice(text), Some(CA_AS_SERVER_ADVICE));
        assert_eq!(advice("invalid peer certificate: UnknownIssuer"), None);
    }
}
