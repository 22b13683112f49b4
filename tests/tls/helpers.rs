//! What the TLS tests share: a PKI made in the test (a CA, server and client certificates in a
//! temporary directory), file paths as TOML strings, a router started from config text, and the
//! listeners on ephemeral ports.

use std::path::{Path, PathBuf};

use rankgate::app::Router;
use rankgate::config::{Config, ListenerTls};
use rankgate::tls::Upstream;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use rustls_pki_types::CertificateDer;

/// A test CA and the files of the certificates it signs, in a directory of the test's own.
pub struct Pki {
    pub dir: PathBuf,
    issuer: Issuer<'static, KeyPair>,
    pub ca_file: PathBuf,
}

impl Pki {
    pub fn new(name: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("rankgate-tls-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("rankgate test CA {name}"));
        let ca = params.self_signed(&key).unwrap();
        let ca_file = dir.join("ca.pem");
        std::fs::write(&ca_file, ca.pem()).unwrap();
        Pki {
            issuer: Issuer::new(params, key),
            dir,
            ca_file,
        }
    }

    /// A certificate for 127.0.0.1 and localhost (server and client use), written as
    /// `<name>.pem` and `<name>.key`; returns the files and the certificate's DER.
    pub fn issue(&self, name: &str) -> (ListenerTls, CertificateDer<'static>) {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let files = ListenerTls {
            cert_file: self.dir.join(format!("{name}.pem")),
            key_file: self.dir.join(format!("{name}.key")),
            client_ca_file: None,
        };
        std::fs::write(&files.cert_file, cert.pem()).unwrap();
        std::fs::write(&files.key_file, key.serialize_pem()).unwrap();
        (files, cert.der().clone())
    }

    /// A client that trusts this CA only.
    pub fn trust(&self) -> Upstream {
        Upstream::trusting(Some(&self.ca_file)).unwrap()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn toml_path(p: &Path) -> String {
    format!("{:?}", p.display().to_string())
}

pub async fn start(text: &str) -> Router {
    let cfg = Config::from_str(text).unwrap_or_else(|e| panic!("config: {e}\n{text}"));
    Router::start(cfg).await.expect("start router")
}

pub fn ports() -> &'static str {
    "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n"
}
