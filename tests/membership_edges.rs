//! Runtime membership at its edges, from an attack review: edits and source changes that must
//! not make an engine unroutable, a discovered engine coming back when the file lets it go, and
//! config errors that `check` must catch like `serve`.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use hickory_server::authority::MessageResponseBuilder;
use hickory_server::proto::op::{Header, ResponseCode};
use hickory_server::proto::rr::rdata::A;
use hickory_server::proto::rr::{LowerName, Name, RData, Record, RecordType};
use hickory_server::server::{
    Request as DnsRequest, RequestHandler, ResponseHandler, ResponseInfo,
};
use hickory_server::ServerFuture;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use rankgate::app::Router;
use rankgate::config::Config;
use rankgate::sim::SimConfig;
use serde_json::Value;
use tokio::net::UdpSocket;

const TOKEN: &str = "attack-admin-token";

fn token_env() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let var = format!(
        "RANKGATE_ATTACK_ADMIN_TOKEN_{}_{}",
        std::process::id(),
        N.fetch_add(1, Relaxed)
    );
    std::env::set_var(&var, TOKEN);
    format!("admin_token_env = \"{var}\"\n")
}

/// A config file in the temp directory, removed when dropped.
struct TempConfig(PathBuf);

impl TempConfig {
    fn new(text: &str) -> TempConfig {
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "rankgate-attack-{}-{}.toml",
            std::process::id(),
            N.fetch_add(1, Relaxed)
        ));
        std::fs::write(&path, text).unwrap();
        TempConfig(path)
    }

    fn write(&self, text: &str) {
        std::fs::write(&self.0, text).unwrap();
    }
}

impl Drop for TempConfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

async fn admin(r: &Router, method: Method, path: &str, body: Option<Value>) -> Reply {
    let req = Request::builder()
        .method(method)
        .uri(format!("http://{}{path}", r.admin_addr))
        .header("authorization", format!("Bearer {TOKEN}"));
    let body = body.map_or(Bytes::new(), |b| Bytes::from(b.to_string()));
    send(req.body(Full::new(body)).unwrap()).await
}

/// `(url, origin)` of every engine, from `GET /engines`.
async fn engines(r: &Router) -> Vec<(String, String)> {
    match get(r.admin_addr, "/engines").await.json() {
        Value::Array(rows) => rows
            .iter()
            .map(|e| {
                (
                    e["url"].as_str().unwrap_or("").to_string(),
                    e["origin"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect(),
        other => panic!("/engines is not an array: {other}"),
    }
}

/// A reload that changes only a non-identity key of an engine (here `models`, which the engine
/// already serves) must not make its ranks unknown: its workers carry on with their telemetry.
/// Otherwise every request fails with 503 until the new poller's first poll lands (one
/// `/metrics` round trip: up to seconds on a saturated vLLM), and `/ready` flips to 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_edits_an_engines_keys_keeps_its_ranks_routable() {
    let a = engine(SimConfig::default()).await;
    let head = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}\
         [telemetry]\ninterval = \"100ms\"\nstale_after = \"5s\"\n",
        token_env()
    );
    let file = TempConfig::new(&format!("{head}{}", engine_toml(&a.url(), "vllm", 2, 0)));
    let r = Router::start_from(Config::load(&file.0).unwrap(), Some(file.0.clone()))
        .await
        .unwrap();
    wait_state(&r, &[0, 1], "available").await;
    // Polls now take 1.5 s, as on a busy engine; the last numbers stay fresh (stale_after 5 s).
    a.set_metrics_delay(Duration::from_millis(1500));
    assert_eq!(chat(r.addr, 2).await.status, StatusCode::OK);

    file.write(&format!(
        "{head}{}models = [\"tiny-llama\"]\n",
        engine_toml(&a.url(), "vllm", 2, 0)
    ));
    let reply = admin(&r, Method::POST, "/reload", None).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);

    let ready = get(r.admin_addr, "/ready").await.status;
    let reply = chat(r.addr, 2).await;
    assert_eq!(
        (reply.status, ready),
        (StatusCode::OK, StatusCode::OK),
        "the same engine, one key edited, became unroutable: {}",
        String::from_utf8_lossy(&reply.body)
    );
    a.set_metrics_delay(Duration::ZERO);
    r.shutdown().await;
}

/// The file naming an engine the admin API added, with the very same keys, changes nothing
/// about that engine: its ranks stay routable, and the reload reports it changed, not added and
/// removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_the_file_takes_over_from_the_admin_api_stays_routable() {
    let a = engine(SimConfig::default()).await;
    let head = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}\
         [telemetry]\ninterval = \"100ms\"\nstale_after = \"5s\"\n",
        token_env()
    );
    let file = TempConfig::new(&head);
    let r = Router::start_from(Config::load(&file.0).unwrap(), Some(file.0.clone()))
        .await
        .unwrap();
    let body = serde_json::json!({"url": a.url(), "flavor": "vllm", "dp_size": 2, "start_rank": 0});
    assert_eq!(
        admin(&r, Method::POST, "/engines", Some(body)).await.status,
        StatusCode::OK
    );
    wait_state(&r, &[0, 1], "available").await;
    a.set_metrics_delay(Duration::from_millis(1500));

    file.write(&format!("{head}{}", engine_toml(&a.url(), "vllm", 2, 0)));
    let reply = admin(&r, Method::POST, "/reload", None).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(engines(&r).await, [(a.url(), "config".to_string())]);

    let reply = chat(r.addr, 2).await;
    assert_eq!(
        reply.status,
        StatusCode::OK,
        "an unchanged engine moved from admin to config became unroutable: {}",
        String::from_utf8_lossy(&reply.body)
    );
    a.set_metrics_delay(Duration::ZERO);
    r.shutdown().await;
}

const NAME: &str = "engines.attack.test.";

/// Answers A for [`NAME`] with one fixed address (AAAA: no records).
struct OneA(LowerName, IpAddr);

#[async_trait::async_trait]
impl RequestHandler for OneA {
    async fn handle_request<R: ResponseHandler>(
        &self,
        request: &DnsRequest,
        mut response: R,
    ) -> ResponseInfo {
        let mut header = Header::response_from_request(request.header());
        header.set_authoritative(true);
        let Ok(info) = request.request_info() else {
            header.set_response_code(ResponseCode::FormErr);
            return header.into();
        };
        let name = Name::from(info.query.name());
        let records: Vec<Record> = match (self.1, info.query.query_type()) {
            _ if info.query.name() != &self.0 => {
                header.set_response_code(ResponseCode::NXDomain);
                vec![]
            }
            (IpAddr::V4(a), RecordType::A) => {
                vec![Record::from_rdata(name, 300, RData::A(A(a)))]
            }
            _ => vec![],
        };
        let message = MessageResponseBuilder::from_message_request(request).build(
            header,
            &records,
            &[],
            &[],
            &[],
        );
        response
            .send_response(message)
            .await
            .unwrap_or(header.into())
    }
}

/// An address the file takes over from discovery returns to discovery when the file drops it,
/// although DNS discovery (like Kubernetes) reports only when its set changes: membership keeps
/// each source's last set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discovered_engine_the_file_drops_again_returns_to_discovery() {
    let a = engine(SimConfig::default()).await;
    let port: u16 = a.url().rsplit(':').next().unwrap().parse().unwrap();
    let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let dns: SocketAddr = socket.local_addr().unwrap();
    let mut server = ServerFuture::new(OneA(
        LowerName::from(Name::from_ascii(NAME).unwrap()),
        "127.0.0.1".parse().unwrap(),
    ));
    server.register_socket(socket);

    let head = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{}{FAST}\
         [[discovery]]\nkind = \"dns\"\nname = \"{NAME}\"\nresolver = \"{dns}\"\n\
         interval = \"100ms\"\nport = {port}\nflavor = \"vllm\"\ndp_size = 2\n",
        token_env()
    );
    let file = TempConfig::new(&head);
    let r = Router::start_from(Config::load(&file.0).unwrap(), Some(file.0.clone()))
        .await
        .unwrap();
    let discovered = vec![(a.url(), "discovery[0]".to_string())];
    let deadline = Instant::now() + Duration::from_secs(5);
    while engines(&r).await != discovered {
        assert!(
            Instant::now() < deadline,
            "never discovered: {:?}",
            engines(&r).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The file names it (taking it over), then no longer does.
    file.write(&format!("{head}{}", engine_toml(&a.url(), "vllm", 2, 0)));
    assert_eq!(
        admin(&r, Method::POST, "/reload", None).await.status,
        StatusCode::OK
    );
    assert_eq!(engines(&r).await, [(a.url(), "config".to_string())]);
    file.write(&head);
    assert_eq!(
        admin(&r, Method::POST, "/reload", None).await.status,
        StatusCode::OK
    );

    // DNS still answers with its address: within 20 discovery intervals it is back.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let now = engines(&r).await;
        if now == discovered {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "DNS still names {} but the fleet is {now:?}",
            a.url()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(chat(r.addr, 2).await.status, StatusCode::OK);
    r.shutdown().await;
    drop(server);
}

/// `http://:8000` has no host: refused, rather than polled and failing with a DNS error forever.
#[test]
fn an_engine_url_without_a_host_is_refused() {
    let err = Config::from_str("[[engines]]\nurl = \"http://:8000\"\nflavor = \"vllm\"\n");
    assert!(err.is_err(), "accepted an engine url without a host");
}

/// A DNS discovery name that is not a DNS name is a config error at load (and in `rankgate
/// check`), not a discovery that never starts and an empty fleet for good.
#[test]
fn a_dns_discovery_name_that_is_not_a_dns_name_is_refused_at_load() {
    let err = Config::from_str(
        "[[discovery]]\nkind = \"dns\"\nname = \"-bad..name\"\nport = 8000\nflavor = \"vllm\"\n",
    );
    assert!(err.is_err(), "accepted a DNS name with an empty label");
}

/// README: "`rankgate check` and `rankgate serve` exit with code 64 on any config error, naming
/// the file, the key and the problem": a `server.admin_token_env` naming an unset variable too.
#[test]
fn an_unset_admin_token_variable_is_a_config_error_for_check_and_serve() {
    let var = format!("RANKGATE_ATTACK_UNSET_{}", std::process::id());
    let file = TempConfig::new(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nadmin_token_env = \"{var}\"\n"
    ));
    let bin = env!("CARGO_BIN_EXE_rankgate");
    let check = Command::new(bin)
        .args(["check", "--config"])
        .arg(&file.0)
        .env_remove(&var)
        .output()
        .unwrap();
    let mut serve = Command::new(bin)
        .args(["serve", "--config"])
        .arg(&file.0)
        .env_remove(&var)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let serve_status = loop {
        if let Some(s) = serve.try_wait().unwrap() {
            break s.code();
        }
        if Instant::now() > deadline {
            let _ = serve.kill();
            let _ = serve.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        (check.status.code(), serve_status),
        (Some(64), Some(64)),
        "check: {}",
        String::from_utf8_lossy(&check.stderr)
    );
}
