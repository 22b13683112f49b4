//! Certificates as an operator meets them, over real sockets: a listener's certificate near or
//! past its end is warned of (`rankgate check`, the start, a reload) and its end is on
//! `/metrics`; a CA certificate served as a server's own is explained where the error shows;
//! and the README's openssl recipe, run as written, makes a pair rankgate serves and a client
//! trusts through the CA.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use common::binary::Rankgate;
use common::*;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use rankgate::app::Router;
use rankgate::config::{Config, ListenerTls};
use rankgate::tls::{Upstream, CA_AS_SERVER_ADVICE};
use rankgate_sim::sim::SimConfig;
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use rustls_pki_types::pem::PemObject;

/// A directory of the test's own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("rankgate-certops-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A self-signed certificate for 127.0.0.1 and localhost ending at `not_after` (a CA one if
/// `ca`), written as `<name>.pem` and `<name>.key`.
fn self_signed(dir: &Path, name: &str, not_after: (i32, u8, u8), ca: bool) -> ListenerTls {
    let key = KeyPair::generate().unwrap();
    let mut params =
        CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
    params.not_after = rcgen::date_time_ymd(not_after.0, not_after.1, not_after.2);
    if ca {
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    }
    let cert = params.self_signed(&key).unwrap();
    let files = ListenerTls {
        cert_file: dir.join(format!("{name}.pem")),
        key_file: dir.join(format!("{name}.key")),
        client_ca_file: None,
    };
    std::fs::write(&files.cert_file, cert.pem()).unwrap();
    std::fs::write(&files.key_file, key.serialize_pem()).unwrap();
    files
}

/// The UTC date `days` from now, as (year, month, day).
fn date_in(days: i64) -> (i32, u8, u8) {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let text = rankgate::x509::utc_text(now + days * 86_400);
    let n = |r: std::ops::Range<usize>| text[r].parse::<i32>().unwrap();
    (n(0..4), n(5..7) as u8, n(8..10) as u8)
}

fn tls_toml(table: &str, t: &ListenerTls) -> String {
    format!(
        "[{table}]\ncert_file = {:?}\nkey_file = {:?}\n",
        t.cert_file.display().to_string(),
        t.key_file.display().to_string()
    )
}

const PORTS: &str = "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n";
const NO_ENGINE: &str =
    "[[engines]]\nurl = \"http://127.0.0.1:9\"\nflavor = \"vllm\"\ndp_size = 1\n";

/// The gauge's value for `listener` on the page, if any.
fn expiry_on(page: &str, listener: &str) -> Option<i64> {
    let series = format!("rankgate_tls_cert_expiry_timestamp_seconds{{listener=\"{listener}\"}} ");
    let line = page.lines().find(|l| l.starts_with(&series))?;
    line[series.len()..].trim().parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_near_or_past_its_end_is_warned_of_and_its_end_is_on_metrics() {
    let dir = Scratch::new("expiry");
    let expired = self_signed(&dir.0, "expired", (2020, 1, 1), false);
    let soon = self_signed(&dir.0, "soon", date_in(3), false);
    let later = self_signed(&dir.0, "later", date_in(200), false);

    // `rankgate check`: a warning, not an error.
    let config = dir.0.join("check.toml");
    std::fs::write(
        &config,
        format!("{PORTS}{}{NO_ENGINE}", tls_toml("server.tls", &expired)),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_rankgate"))
        .args(["check", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("rankgate: warning: server.tls.cert_file")
            && said.contains("expired.pem: the certificate EXPIRED at 2020-01-01 00:00:00 UTC"),
        "{said}"
    );
    std::fs::write(
        &config,
        format!("{PORTS}{}{NO_ENGINE}", tls_toml("server.tls", &later)),
    )
    .unwrap();
    let out = (Command::new(env!("CARGO_BIN_EXE_rankgate")).args(["check", "--config"]))
        .arg(&config)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !said.contains("warning"), "{said}");

    // The start warns of a certificate that ends in 3 days; /metrics says when.
    let serving = ListenerTls {
        cert_file: dir.0.join("serving.pem"),
        key_file: dir.0.join("serving.key"),
        client_ca_file: None,
    };
    let copy = |from: &ListenerTls| {
        std::fs::copy(&from.cert_file, &serving.cert_file).unwrap();
        std::fs::copy(&from.key_file, &serving.key_file).unwrap();
    };
    copy(&soon);
    let mut rg = Rankgate::start(
        "certops",
        &format!("{PORTS}{}{NO_ENGINE}", tls_toml("server.tls", &serving)),
        None,
    )
    .await;
    let line = rg
        .wait_log("the certificate expires at", Duration::from_secs(10))
        .await;
    assert!(
        line.contains("in 2 days") || line.contains("in 3 days"),
        "{line}"
    );
    let der = std::fs::read(&soon.cert_file).unwrap();
    let der = rustls_pki_types::CertificateDer::from_pem_slice(&der).unwrap();
    let soon_end = rankgate::x509::not_after(&der).unwrap();
    let page = String::from_utf8_lossy(&get(rg.admin_addr, "/metrics").await.body).to_string();
    assert_eq!(expiry_on(&page, "server.tls"), Some(soon_end), "{page}");
    assert_eq!(expiry_on(&page, "server.admin_tls"), None);

    // A reload (SIGHUP) to an expired one warns again, and the gauge follows.
    copy(&expired);
    rg.signal(libc::SIGHUP);
    let line = rg
        .wait_log("EXPIRED at 2020-01-01", Duration::from_secs(10))
        .await;
    assert!(line.contains("serving.pem"), "{line}");
    let page = String::from_utf8_lossy(&get(rg.admin_addr, "/metrics").await.body).to_string();
    assert_eq!(
        expiry_on(&page, "server.tls"),
        Some(1_577_836_800),
        "{page}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_served_as_a_servers_certificate_is_explained() {
    let dir = Scratch::new("ca-as-server");
    let ca = self_signed(&dir.0, "ca", date_in(30), true);

    // A client of rankgate's front door told to trust it.
    let e = engine(SimConfig::default()).await;
    let cfg = format!(
        "{PORTS}{}{FAST}{}",
        tls_toml("server.tls", &ca),
        engine_toml(&e.url(), "vllm", 2, 0)
    );
    let r = Router::start(Config::from_str(&cfg).unwrap())
        .await
        .unwrap();
    let client = rankgate::http::client_with::<Full<Bytes>>(
        Duration::from_secs(2),
        &Upstream::trusting(Some(&ca.cert_file)).unwrap(),
    );
    let req = Request::get(format!("https://127.0.0.1:{}/v1/models", r.addr.port()))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let err = client.request(req).await.unwrap_err();
    let said = rankgate::http::error_chain(&err);
    assert!(
        said.contains("CaUsedAsEndEntity") && said.contains(CA_AS_SERVER_ADVICE),
        "{said}"
    );
    r.shutdown().await;

    // An engine that serves it, reached with it as engine_tls.ca_file: the rank's reason says
    // what to do.
    let e = engine(SimConfig {
        tls: Some(ca.clone()),
        ..SimConfig::default()
    })
    .await;
    let cfg = format!(
        "{PORTS}{FAST}[engine_tls]\nca_file = {:?}\n{}",
        ca.cert_file.display().to_string(),
        engine_toml(&e.url(), "vllm", 2, 0)
    );
    let r = Router::start(Config::from_str(&cfg).unwrap())
        .await
        .unwrap();
    let rows = wait_workers(&r, Duration::from_secs(10), |rows| {
        (rows[0]["reason"].as_str()).is_some_and(|s| s.contains("this certificate is a CA"))
    })
    .await;
    assert_eq!(rows[0]["telemetry"], "unavailable", "{rows:?}");
    r.shutdown().await;
}

/// The README's recipe, between its markers, as a shell script.
fn readme_recipe() -> String {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let (begin, end) = (
        "<!-- openssl-recipe:begin -->",
        "<!-- openssl-recipe:end -->",
    );
    let start = readme
        .find(begin)
        .expect("README has the recipe's begin marker")
        + begin.len();
    let stop = readme
        .find(end)
        .expect("README has the recipe's end marker");
    let block = &readme[start..stop];
    let body = block.split_once("```sh\n").expect("a ```sh block").1;
    body.rsplit_once("```")
        .expect("the block ends")
        .0
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_openssl_recipe_makes_a_pair_rankgate_serves() {
    let dir = Scratch::new("recipe");
    let ran = Command::new("sh")
        .arg("-ec")
        .arg(readme_recipe())
        .current_dir(&dir.0)
        .output()
        .unwrap_or_else(|e| panic!("sh: {e}"));
    assert!(
        ran.status.success(),
        "the recipe failed (is openssl installed?):\n{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    let files = ListenerTls {
        cert_file: dir.0.join("tls.crt"),
        key_file: dir.0.join("tls.key"),
        client_ca_file: None,
    };
    let e = engine(SimConfig::default()).await;
    let cfg = format!(
        "{PORTS}{}{FAST}{}",
        tls_toml("server.tls", &files),
        engine_toml(&e.url(), "vllm", 2, 0)
    );
    let r = Router::start(Config::from_str(&cfg).unwrap())
        .await
        .unwrap();
    wait_state(&r, &[0, 1], "available").await;
    let trust = Upstream::trusting(Some(&dir.0.join("ca.crt"))).unwrap();
    let client = rankgate::http::client_with::<Full<Bytes>>(Duration::from_secs(2), &trust);
    // By address and by name: the certificate names both.
    for host in ["127.0.0.1", "localhost"] {
        let req = Request::post(format!(
            "https://{host}:{}/v1/chat/completions",
            r.addr.port()
        ))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(chat_body(4, false))))
        .unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
            .await
            .expect("answered within 10 s")
            .unwrap_or_else(|e| panic!("{host}: {}", rankgate::http::error_chain(&e)));
        assert_eq!(resp.status(), StatusCode::OK, "{host}");
        resp.into_body().collect().await.unwrap();
    }
    r.shutdown().await;
}
