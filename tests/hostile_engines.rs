//! Engines that misbehave in ways a front door exposed to the world must absorb, over real
//! sockets: a TLS handshake that hangs, an h2 (gRPC) engine that never sends its SETTINGS (both
//! bounded by `server.connect_timeout`, failed over and ejected), an engine answering 500
//! (retried by `routing.retry_on` only), and one server added again under another name (the
//! admin API and a reload say so).
//!
//! Every wait is bounded in time and count; the time bounds are generous behaviour checks, not
//! speed figures (those are `bench/hostile/engines.sh`'s).

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use common::admin::{admin, token_env, TempConfig, TOKEN};
use common::grpc::{front, Eng};
use common::*;
use http::{Method, StatusCode};
use rankgate::app::Router;
use rankgate::config::{Config, ListenerTls};
use rankgate_sim::sim::{SimConfig, SimFlavor as Flavor};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::{timeout, Instant};

/// The connect timeout of these tests: small, so a hung engine costs little.
const CONNECT: Duration = Duration::from_millis(300);

/// Bound on a request's answer while an engine hangs: the connect timeout and a second.
const ANSWER_WITHIN: Duration = Duration::from_millis(1300);

/// A front for the server at `to` that passes connections through until [`Door::hang`]; then
/// it accepts new ones and never answers (nor reads) them: a TLS terminator or h2 server that
/// hangs in the handshake. Connections passed through before stay as they were, as a hung
/// engine's kept telemetry connection would.
struct Door {
    addr: SocketAddr,
    hung: Arc<AtomicBool>,
    /// Connections held silent since the hang.
    held: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Door {
    async fn start(to: SocketAddr) -> Door {
        let listener = TcpListener::bind(loopback()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (hung, held) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicUsize::new(0)),
        );
        let (h, n) = (hung.clone(), held.clone());
        let task = tokio::spawn(async move {
            // Held until the door is dropped: the test's few attempts.
            let mut silent = Vec::new();
            while let Ok((mut s, _)) = listener.accept().await {
                if h.load(SeqCst) {
                    n.fetch_add(1, SeqCst);
                    silent.push(s);
                    continue;
                }
                tokio::spawn(async move {
                    if let Ok(mut up) = TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut s, &mut up).await;
                    }
                });
            }
        });
        Door {
            addr,
            hung,
            held,
            task,
        }
    }

    fn hang(&self) {
        self.hung.store(true, SeqCst);
    }

    fn held(&self) -> usize {
        self.held.load(SeqCst)
    }
}

impl Drop for Door {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A test CA and a server certificate for 127.0.0.1 it signed, in a directory of the test's own.
struct Pki {
    dir: PathBuf,
    ca_file: PathBuf,
    server: ListenerTls,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!(
            "rankgate-hostile-engines-{}-{name}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "rankgate hostile engines CA");
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let ca_file = dir.join("ca.pem");
        std::fs::write(&ca_file, ca_cert.pem()).unwrap();
        let issuer = Issuer::new(ca, ca_key);
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        let cert = leaf.signed_by(&key, &issuer).unwrap();
        let server = ListenerTls {
            cert_file: dir.join("engine.pem"),
            key_file: dir.join("engine.key"),
            client_ca_file: None,
        };
        std::fs::write(&server.cert_file, cert.pem()).unwrap();
        std::fs::write(&server.key_file, key.serialize_pem()).unwrap();
        Pki {
            dir,
            ca_file,
            server,
        }
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A sample from the admin `/metrics` (0 when absent).
async fn metric(r: &Router, series: &str) -> f64 {
    let text = String::from_utf8_lossy(&get(r.admin_addr, "/metrics").await.body).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Sends requests with `send` until rank 0 (the hung engine's) is ejected, at most 10; each
/// must be answered within [`ANSWER_WITHIN`] by `good` (the reply's worker starts with it).
/// Returns how many it took and the slowest answer.
async fn until_ejected<F, Fut>(r: &Router, good: &str, send: F) -> (usize, Duration)
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = (bool, String)>,
{
    let mut slowest = Duration::ZERO;
    for n in 1..=10 {
        let started = Instant::now();
        let (ok, worker) = timeout(ANSWER_WITHIN, send(n))
            .await
            .unwrap_or_else(|_| panic!("request {n} not answered within {ANSWER_WITHIN:?}"));
        slowest = slowest.max(started.elapsed());
        assert!(ok, "request {n} failed (worker {worker:?})");
        assert!(
            worker.starts_with(good),
            "request {n} served by {worker:?}, not {good}"
        );
        let rows = workers(r).await;
        if rows[0]["reason_kind"] == "ejected" {
            let reason = rows[0]["reason"].as_str().unwrap_or("");
            assert!(
                reason.starts_with("ejected: 2 consecutive transport errors"),
                "{reason}"
            );
            return (n, slowest);
        }
    }
    panic!("not ejected after 10 requests: {:#?}", workers(r).await);
}

/// An `https://` engine whose TLS handshake hangs (it accepts and never answers the
/// ClientHello) costs each request at most the connect timeout: the request is answered by the
/// other engine, and the hung one is ejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_tls_handshake_fails_over_within_the_connect_timeout_and_is_ejected() {
    let pki = Pki::new("tls");
    // The hung engine looks idle, the good one busy: least_kv goes to the hung one first.
    let tls = engine(SimConfig {
        tls: Some(pki.server.clone()),
        kv_usage: vec![0.0],
        ..sim(Flavor::Vllm, 1, 0)
    })
    .await;
    let good = engine(SimConfig {
        kv_usage: vec![0.5],
        ..sim(Flavor::Vllm, 1, 1)
    })
    .await;
    let tls_addr: SocketAddr = tls.url().trim_start_matches("https://").parse().unwrap();
    let door = Door::start(tls_addr).await;
    let hung_url = format!("https://{}", door.addr);
    let r = router_with(
        &format!("connect_timeout = \"{}ms\"", CONNECT.as_millis()),
        &format!(
            "[routing]\neject_after = 2\neject_for = \"30s\"\n[engine_tls]\nca_file = \"{}\"\n{FAST}",
            pki.ca_file.display()
        ),
        &[
            engine_toml(&hung_url, "vllm", 1, 0),
            engine_toml(&good.url(), "vllm", 1, 1),
        ],
    )
    .await;
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows[0]["telemetry"] == "available" && rows[1]["kv_usage"] == 0.5
    })
    .await;
    // No request went to it yet: the front door opens its first connection to it from now on,
    // while telemetry keeps the connection it has.
    door.hang();
    let addr = r.addr;
    let (n, slowest) = until_ejected(&r, &format!("{}@", good.url()), |_| async move {
        let reply = chat(addr, 2).await;
        (reply.status == StatusCode::OK, reply.worker())
    })
    .await;
    // Each attempt on the hung engine met a silent handshake and failed over once (least_kv may
    // send some requests straight to the good engine once the failures weigh on the score).
    let retries = r.metrics.retries_total();
    assert!(retries >= 2, "{retries} retries");
    assert!(
        door.held() as u64 >= retries,
        "the attempts met the hung handshake"
    );
    let id = format!("{hung_url}@0");
    assert_eq!(
        metric(&r, &format!("rankgate_rank_ejected{{worker=\"{id}\"}}")).await,
        1.0
    );
    // Ejected: the next ones go straight to the good engine.
    let held = door.held();
    for _ in 0..3 {
        let reply = timeout(ANSWER_WITHIN, chat(r.addr, 2)).await.unwrap();
        assert_eq!(reply.status, StatusCode::OK);
    }
    assert_eq!(door.held(), held, "no attempt on an ejected engine");
    println!("hung TLS handshake: ejected after {n} requests, slowest answer {slowest:?} (connect_timeout {CONNECT:?})");
    r.shutdown().await;
}

/// An h2 (gRPC) engine that accepts and never sends its SETTINGS: the calls sent on that
/// connection fail once the connect timeout has passed and go to the other engine; the silent
/// one is ejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_h2_engine_fails_over_within_the_connect_timeout_and_is_ejected() {
    let silent = Eng::start(Flavor::Vllm, 1, 0).await;
    let good = Eng::start(Flavor::Vllm, 1, 1).await;
    silent.sim.set_kv_usage(vec![0.0]);
    good.sim.set_kv_usage(vec![0.5]);
    let door = Door::start(silent.grpc).await;
    let r = router_with(
        &format!(
            "connect_timeout = \"{}ms\"\ngrpc_listen = \"127.0.0.1:0\"",
            CONNECT.as_millis()
        ),
        &format!("[routing]\neject_after = 2\neject_for = \"30s\"\n{FAST}"),
        &[
            common::grpc::grpc_toml(door.addr, Flavor::Vllm, 1, 0),
            good.toml(),
        ],
    )
    .await;
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows[0]["telemetry"] == "available" && rows[1]["kv_usage"] == 0.5
    })
    .await;
    door.hang();
    let r_ref = &r;
    let (n, slowest) = until_ejected(&r, &good.worker(1), |n| async move {
        let mut client = front(r_ref, Flavor::Vllm);
        match client.start(&format!("call-{n}"), None, 2).await {
            Ok(mut started) => {
                let done = started.stream.until_complete().await.is_some();
                (done, started.worker.unwrap_or_default())
            }
            Err(status) => (false, format!("{status:?}")),
        }
    })
    .await;
    assert!(
        r.metrics.retries_total() >= 2,
        "each call on it failed over"
    );
    assert!(door.held() >= 1, "the calls met the silent h2 server");
    assert!(good.generated());
    println!("silent h2 engine: ejected after {n} calls, slowest answer {slowest:?} (connect_timeout {CONNECT:?})");
    r.shutdown().await;
}

/// An engine answering 500: with `routing.retry_on = [500]` the request is answered by the
/// other engine, and the 500 counts against its rank; without it the client gets the 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_500_is_retried_only_when_retry_on_lists_it() {
    let failing = engine(SimConfig {
        kv_usage: vec![0.0],
        ..sim(Flavor::Vllm, 1, 0)
    })
    .await;
    let good = engine(SimConfig {
        kv_usage: vec![0.5],
        ..sim(Flavor::Vllm, 1, 1)
    })
    .await;
    failing.set_fail(500, 100.0).unwrap();
    // The model named in the config: the failing engine's /v1/models fails too.
    let engines = [
        format!(
            "{}models = [\"tiny-llama\"]\n",
            engine_toml(&failing.url(), "vllm", 1, 0)
        ),
        format!(
            "{}models = [\"tiny-llama\"]\n",
            engine_toml(&good.url(), "vllm", 1, 1)
        ),
    ];
    let ready = |rows: &[Value]| rows[0]["telemetry"] == "available" && rows[1]["kv_usage"] == 0.5;

    let plain = router(FAST, &engines).await;
    wait_workers(&plain, Duration::from_secs(10), ready).await;
    let reply = chat(plain.addr, 2).await;
    assert_eq!(
        reply.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{:?}",
        reply.body
    );
    assert!(
        reply.worker().starts_with(&failing.url()),
        "{}",
        reply.worker()
    );
    assert_eq!(plain.metrics.retries_total(), 0);
    assert_eq!(workers(&plain).await[0]["consecutive_failures"], 1);
    plain.shutdown().await;

    let before = failing.requests_received();
    let retrying = router(&format!("[routing]\nretry_on = [500]\n{FAST}"), &engines).await;
    wait_workers(&retrying, Duration::from_secs(10), ready).await;
    let reply = chat(retrying.addr, 2).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert!(
        reply.worker().starts_with(&format!("{}@", good.url())),
        "{}",
        reply.worker()
    );
    assert_eq!(failing.requests_received(), before + 1, "tried there first");
    assert_eq!(retrying.metrics.retries_total(), 1);
    // The retried 500 counts against its rank, as any 5xx does.
    let rows = workers(&retrying).await;
    assert_eq!(rows[0]["consecutive_failures"], 1, "{rows:#?}");
    assert_eq!(rows[1]["consecutive_failures"], 0);
    retrying.shutdown().await;
}

/// The same server added again under another name (`localhost` for `127.0.0.1`) is accepted,
/// with a warning in the admin API's answer, and a reload bringing it says so too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_name_of_a_server_in_the_fleet_is_accepted_with_a_warning() {
    let e = engine(SimConfig::default()).await;
    let port = e.url().rsplit(':').next().unwrap().to_string();
    let (ip_url, name_url) = (
        format!("http://127.0.0.1:{port}"),
        format!("http://localhost:{port}"),
    );
    let own = |url: &str| format!("[[engines]]\nurl = \"{url}\"\nflavor = \"vllm\"\ndp_size = 2\n");
    let head = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}{FAST}",
        token_env()
    );
    let file = TempConfig::new(&format!("{head}{}", own(&ip_url)));
    let r = Router::start_from(Config::load(&file.0).unwrap(), Some(file.0.clone()))
        .await
        .unwrap();
    wait_state(&r, &[0, 1], "available").await;

    let add = json!({"url": name_url, "flavor": "vllm", "dp_size": 2});
    let reply = admin(&r, Method::POST, "/engines", Some(TOKEN), Some(add)).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let v = reply.json();
    assert_eq!(v["added"], json!([name_url]));
    let warnings = v["warnings"].as_array().expect("a warnings array");
    assert_eq!(warnings.len(), 1, "{v}");
    let w = warnings[0].as_str().unwrap();
    assert!(
        w.contains(&format!("{ip_url} (from config)"))
            && w.contains(&format!("{name_url} (from admin)"))
            && w.contains(&format!("127.0.0.1:{port}"))
            && w.contains("counted twice"),
        "{w}"
    );
    // Accepted all the same: four ranks now, two of them the same server's.
    wait_workers(&r, Duration::from_secs(10), |rows| rows.len() == 4).await;

    // Removed, then brought back by a reload of the file: the reload's answer says so.
    let reply = admin(
        &r,
        Method::DELETE,
        &format!("/engines?url={name_url}"),
        Some(TOKEN),
        None,
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert!(
        reply.json().get("warnings").is_none(),
        "a removal brings nothing to check"
    );
    file.write(&format!("{head}{}{}", own(&ip_url), own(&name_url)));
    let reply = admin(&r, Method::POST, "/reload", Some(TOKEN), None).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let v = reply.json();
    assert_eq!(v["added"], json!([name_url]));
    let w = v["warnings"][0].as_str().unwrap_or("");
    assert!(
        w.contains(&format!("{name_url} (from config)")) && w.contains("counted twice"),
        "{v}"
    );
    // A reload that brings nothing new warns about nothing again.
    let reply = admin(&r, Method::POST, "/reload", Some(TOKEN), None).await;
    assert!(reply.json().get("warnings").is_none(), "{:?}", reply.body);
    r.shutdown().await;
}
