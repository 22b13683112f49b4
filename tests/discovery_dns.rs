//! DNS discovery against a real DNS server: an in-process authoritative server (hickory-server)
//! on a UDP socket bound to 127.0.0.1:0, answering A/AAAA for one name from state each test
//! changes at runtime, including answering SERVFAIL or not at all.

mod common;

use common::admin::{admin, token_env, TempConfig, TOKEN};

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hickory_server::authority::MessageResponseBuilder;
use hickory_server::proto::op::{Header, ResponseCode};
use hickory_server::proto::rr::rdata::{A, AAAA};
use hickory_server::proto::rr::{LowerName, Name, RData, Record, RecordType};
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::ServerFuture;
use rankgate::config::Config;
use rankgate::discovery::dns;
use rankgate::worker::Engine;
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

const NAME: &str = "engines.rankgate.test.";
const INTERVAL: Duration = Duration::from_millis(100);
/// The longest any test waits for something that should happen.
const WAIT: Duration = Duration::from_secs(5);
/// A long TTL on every record: discovery must not cache it.
const TTL: u32 = 300;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// Answer from `ips`: records, or NOERROR with none (NODATA).
    Answer,
    /// NXDOMAIN: the name does not exist.
    Gone,
    ServFail,
    /// A answered from `ips`, AAAA SERVFAIL: one family's server trouble.
    ServFailAaaa,
    /// Read the query and never answer.
    Silent,
}

struct Zone {
    mode: Mode,
    ips: Vec<IpAddr>,
}

/// Answers A and AAAA for [`NAME`] from the shared zone; counts the queries it reads.
struct Handler {
    name: LowerName,
    zone: Arc<Mutex<Zone>>,
    queries: watch::Sender<u64>,
}

#[async_trait::async_trait]
impl RequestHandler for Handler {
    async fn handle_request<R: ResponseHandler>(
        &self,
        request: &Request,
        mut response: R,
    ) -> ResponseInfo {
        self.queries.send_modify(|n| *n += 1);
        let mut header = Header::response_from_request(request.header());
        header.set_authoritative(true);
        let Ok(info) = request.request_info() else {
            header.set_response_code(ResponseCode::FormErr);
            return header.into();
        };
        let (mode, ips) = {
            let z = self.zone.lock().unwrap();
            (z.mode, z.ips.clone())
        };
        let mode = match mode {
            _ if info.query.name() != &self.name => Mode::Gone,
            Mode::ServFailAaaa if info.query.query_type() == RecordType::AAAA => Mode::ServFail,
            Mode::ServFailAaaa => Mode::Answer,
            m => m,
        };
        let name = Name::from(info.query.name());
        let records: Vec<Record> = match mode {
            Mode::Silent => return header.into(),
            Mode::Gone => {
                header.set_response_code(ResponseCode::NXDomain);
                vec![]
            }
            Mode::ServFail | Mode::ServFailAaaa => {
                header.set_response_code(ResponseCode::ServFail);
                vec![]
            }
            Mode::Answer => ips
                .iter()
                .filter_map(|ip| match (ip, info.query.query_type()) {
                    (IpAddr::V4(a), RecordType::A) => Some(RData::A(A(*a))),
                    (IpAddr::V6(a), RecordType::AAAA) => Some(RData::AAAA(AAAA(*a))),
                    _ => None,
                })
                .map(|rdata| Record::from_rdata(name.clone(), TTL, rdata))
                .collect(),
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

struct DnsServer {
    addr: SocketAddr,
    zone: Arc<Mutex<Zone>>,
    queries: watch::Receiver<u64>,
    // Dropping it stops the server (its tasks live in its JoinSet).
    _server: ServerFuture<Handler>,
}

impl DnsServer {
    async fn start(mode: Mode, ips: &[&str]) -> DnsServer {
        let zone = Arc::new(Mutex::new(Zone {
            mode,
            ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
        }));
        let (queries_tx, queries) = watch::channel(0);
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let mut server = ServerFuture::new(Handler {
            name: LowerName::from(Name::from_ascii(NAME).unwrap()),
            zone: zone.clone(),
            queries: queries_tx,
        });
        server.register_socket(socket);
        DnsServer {
            addr,
            zone,
            queries,
            _server: server,
        }
    }

    fn set(&self, mode: Mode, ips: &[&str]) {
        let mut z = self.zone.lock().unwrap();
        z.mode = mode;
        z.ips = ips.iter().map(|s| s.parse().unwrap()).collect();
    }

    /// Waits until the server has read `more` queries beyond those read so far.
    async fn await_queries(&mut self, more: u64) {
        let target = *self.queries.borrow_and_update() + more;
        tokio::time::timeout(WAIT, self.queries.wait_for(|n| *n >= target))
            .await
            .expect("discovery keeps asking")
            .unwrap();
    }
}

struct Discovery {
    sets: mpsc::Receiver<Vec<Engine>>,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// Starts DNS discovery of [`NAME`] at `server`, engines on port 8000 with 2 DP ranks.
fn discover(server: SocketAddr) -> Discovery {
    let c = Config::from_str(&format!(
        "[[discovery]]\nkind = \"dns\"\nname = \"{NAME}\"\nresolver = \"{server}\"\ninterval = \"{}ms\"\nport = 8000\nflavor = \"vllm\"\ndp_size = 2",
        INTERVAL.as_millis()
    ))
    .unwrap();
    let d = c.discovery.into_iter().next().unwrap();
    let (tx, sets) = mpsc::channel(8);
    let (shutdown, rx) = watch::channel(false);
    let task = tokio::spawn(dns::run(d, tx, rx));
    Discovery {
        sets,
        shutdown,
        task,
    }
}

impl Discovery {
    /// The urls of the next set reported, waiting at most [`WAIT`].
    async fn next(&mut self) -> Vec<String> {
        let set = tokio::time::timeout(WAIT, self.sets.recv())
            .await
            .expect("a set within the wait")
            .expect("discovery still running");
        assert!(set.iter().all(|e| e.dp_size == 2), "{set:?}");
        set.iter().map(|e| e.url.to_string()).collect()
    }

    /// Asserts nothing is reported for three intervals.
    async fn quiet(&mut self) {
        let got = tokio::time::timeout(INTERVAL * 3, self.sets.recv()).await;
        assert!(got.is_err(), "expected no set, got {got:?}");
    }
}

#[tokio::test]
async fn records_that_come_and_go_are_engines_that_join_and_leave() {
    let dns = DnsServer::start(Mode::Answer, &["127.0.0.2", "127.0.0.1"]).await;
    let mut d = discover(dns.addr);
    assert_eq!(
        d.next().await,
        ["http://127.0.0.1:8000", "http://127.0.0.2:8000"]
    );

    dns.set(Mode::Answer, &["127.0.0.1", "127.0.0.3", "127.0.0.2"]);
    assert_eq!(
        d.next().await,
        [
            "http://127.0.0.1:8000",
            "http://127.0.0.2:8000",
            "http://127.0.0.3:8000"
        ]
    );

    dns.set(Mode::Answer, &["127.0.0.3", "127.0.0.1"]);
    assert_eq!(
        d.next().await,
        ["http://127.0.0.1:8000", "http://127.0.0.3:8000"]
    );

    // NXDOMAIN: the name is gone, and so are its engines.
    dns.set(Mode::Gone, &[]);
    assert_eq!(d.next().await, Vec::<String>::new());

    dns.set(Mode::Answer, &["127.0.0.4"]);
    assert_eq!(d.next().await, ["http://127.0.0.4:8000"]);

    // NODATA: the name exists with no A or AAAA records.
    dns.set(Mode::Answer, &[]);
    assert_eq!(d.next().await, Vec::<String>::new());
}

#[tokio::test]
async fn first_answer_is_reported_even_when_empty() {
    let dns = DnsServer::start(Mode::Gone, &[]).await;
    let mut d = discover(dns.addr);
    assert_eq!(d.next().await, Vec::<String>::new());
}

#[tokio::test]
async fn aaaa_records_are_engines_with_bracketed_urls() {
    let dns = DnsServer::start(Mode::Answer, &["::1"]).await;
    let mut d = discover(dns.addr);
    assert_eq!(d.next().await, ["http://[::1]:8000"]);

    dns.set(Mode::Answer, &["::1", "127.0.0.1"]);
    assert_eq!(
        d.next().await,
        ["http://127.0.0.1:8000", "http://[::1]:8000"]
    );
}

#[tokio::test]
async fn servfail_keeps_the_fleet_until_the_server_answers_again() {
    let mut dns = DnsServer::start(Mode::Answer, &["127.0.0.1", "127.0.0.2"]).await;
    let mut d = discover(dns.addr);
    assert_eq!(
        d.next().await,
        ["http://127.0.0.1:8000", "http://127.0.0.2:8000"]
    );

    dns.set(Mode::ServFail, &[]);
    // Two rounds of A + AAAA failed, and nothing was reported for them.
    dns.await_queries(4).await;
    d.quiet().await;

    dns.set(Mode::Answer, &["127.0.0.3"]);
    assert_eq!(d.next().await, ["http://127.0.0.3:8000"]);
}

#[tokio::test]
async fn one_family_failing_keeps_the_whole_fleet() {
    let mut dns = DnsServer::start(Mode::Answer, &["127.0.0.1", "::1"]).await;
    let mut d = discover(dns.addr);
    assert_eq!(
        d.next().await,
        ["http://127.0.0.1:8000", "http://[::1]:8000"]
    );

    // A still answers; AAAA fails. The IPv6 engine must not leave on a server error.
    dns.set(Mode::ServFailAaaa, &["127.0.0.1", "::1"]);
    dns.await_queries(4).await;
    d.quiet().await;

    dns.set(Mode::Answer, &["127.0.0.1"]);
    assert_eq!(d.next().await, ["http://127.0.0.1:8000"]);
}

#[tokio::test]
async fn a_silent_server_keeps_the_fleet_until_it_answers_again() {
    let mut dns = DnsServer::start(Mode::Answer, &["127.0.0.1"]).await;
    let mut d = discover(dns.addr);
    assert_eq!(d.next().await, ["http://127.0.0.1:8000"]);

    dns.set(Mode::Silent, &[]);
    // A round is A and AAAA, each tried twice: the fifth query opens the next round, so the
    // one before it timed out, and nothing may have been reported for it.
    dns.await_queries(5).await;
    d.quiet().await;

    dns.set(Mode::Answer, &["127.0.0.1", "::1"]);
    assert_eq!(
        d.next().await,
        ["http://127.0.0.1:8000", "http://[::1]:8000"]
    );
}

#[tokio::test]
async fn shutdown_stops_the_task() {
    let dns = DnsServer::start(Mode::Answer, &["127.0.0.1"]).await;
    let mut d = discover(dns.addr);
    assert_eq!(d.next().await, ["http://127.0.0.1:8000"]);
    d.shutdown.send(true).unwrap();
    tokio::time::timeout(WAIT, d.task)
        .await
        .expect("discovery stops on shutdown")
        .unwrap();
}

#[tokio::test]
async fn shutdown_interrupts_an_unanswered_lookup() {
    let mut dns = DnsServer::start(Mode::Silent, &[]).await;
    let d = discover(dns.addr);
    dns.await_queries(1).await;
    d.shutdown.send(true).unwrap();
    // Under the 1 s query timeout: the task did not wait for the lookup to give up.
    tokio::time::timeout(Duration::from_millis(900), d.task)
        .await
        .expect("discovery stops during a lookup")
        .unwrap();
}

#[tokio::test]
async fn dropping_the_receiver_stops_the_task() {
    let dns = DnsServer::start(Mode::Answer, &["127.0.0.1"]).await;
    let mut d = discover(dns.addr);
    assert_eq!(d.next().await, ["http://127.0.0.1:8000"]);
    drop(d.sets);
    tokio::time::timeout(WAIT, d.task)
        .await
        .expect("discovery stops when nobody listens")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_added_and_removed_change_the_routers_fleet() {
    let (a, b, port) = common::engines_on_one_port().await;
    let mut dns = DnsServer::start(Mode::Answer, &["127.0.0.2"]).await;
    let router = dns_router(&dns, port, "flavor = \"vllm\"\ndp_size = 2\n").await;
    let (ea, eb) = (a.url(), b.url());

    // The one record: its engine's two ranks, and traffic goes there.
    let ids = common::wait_available(&router, |ids| ids.len() == 2).await;
    assert_eq!(ids, [format!("{ea}@0"), format!("{ea}@1")]);
    assert_eq!(common::chat(router.addr, 2).await.status, 200);

    // A second record: its engine joins.
    dns.set(Mode::Answer, &["127.0.0.2", "127.0.0.3"]);
    common::wait_available(&router, |ids| ids.len() == 4).await;

    // The first record goes: only the second engine is left, and takes every request.
    dns.set(Mode::Answer, &["127.0.0.3"]);
    let ids = common::wait_available(&router, |ids| {
        ids.len() == 2 && ids.iter().all(|i| i.starts_with(&eb))
    })
    .await;
    assert_eq!(ids, [format!("{eb}@0"), format!("{eb}@1")]);
    assert_eq!(common::workers(&router).await.len(), 2);
    let before = a.requests_received();
    for _ in 0..10 {
        let reply = common::chat(router.addr, 2).await;
        assert_eq!(reply.status, 200);
        assert!(reply.worker().starts_with(&eb), "{}", reply.worker());
    }
    assert_eq!(a.requests_received(), before);

    // The DNS server failing keeps the fleet; the name gone empties it.
    dns.set(Mode::ServFail, &[]);
    dns.await_queries(3).await;
    assert_eq!(common::workers(&router).await.len(), 2);
    assert_eq!(common::chat(router.addr, 2).await.status, 200);
    dns.set(Mode::Gone, &[]);
    common::wait_workers(&router, WAIT, |rows| rows.is_empty()).await;
    let status = common::chat(router.addr, 2).await.status;
    assert_eq!(status, 503, "no engine left: nothing is routable");
    router.shutdown().await;
}

/// A router whose fleet is what `dns` says, engines at `port` with the engine keys `keys`.
async fn dns_router(dns: &DnsServer, port: u16, keys: &str) -> rankgate::app::Router {
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n{}\
         [[discovery]]\nkind = \"dns\"\nname = \"{NAME}\"\nresolver = \"{}\"\ninterval = \"{}ms\"\n\
         port = {port}\n{keys}",
        common::FAST,
        dns.addr,
        INTERVAL.as_millis()
    );
    rankgate::app::Router::start(Config::from_str(&text).unwrap())
        .await
        .unwrap()
}

/// `(url, origin)` of every engine, from `GET /engines`.
async fn engine_origins(r: &rankgate::app::Router) -> Vec<(String, String)> {
    let rows = common::get(r.admin_addr, "/engines").await.json();
    (rows.as_array().expect("/engines is an array").iter())
        .map(|e| {
            let text = |k: &str| e[k].as_str().unwrap_or("").to_string();
            (text("url"), text("origin"))
        })
        .collect()
}

/// An address the file takes over from discovery returns to discovery when the file drops it,
/// although DNS discovery (like Kubernetes) reports only when its set changes: membership keeps
/// each source's last set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discovered_engine_the_file_drops_again_returns_to_discovery() {
    let a = common::engine(rankgate_sim::sim::SimConfig::default()).await;
    let port: u16 = a.url().rsplit(':').next().unwrap().parse().unwrap();
    let server = DnsServer::start(Mode::Answer, &["127.0.0.1"]).await;
    let dns = server.addr;

    let head = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n{}{}\
         [[discovery]]\nkind = \"dns\"\nname = \"{NAME}\"\nresolver = \"{dns}\"\n\
         interval = \"100ms\"\nport = {port}\nflavor = \"vllm\"\ndp_size = 2\n",
        token_env(),
        common::FAST
    );
    let file = TempConfig::new(&head);
    let r = rankgate::app::Router::start_from(Config::load(&file.0).unwrap(), Some(file.0.clone()))
        .await
        .unwrap();
    let discovered = vec![(a.url(), "discovery[0]".to_string())];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while engine_origins(&r).await != discovered {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never discovered: {:?}",
            engine_origins(&r).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The file names it (taking it over), then no longer does.
    file.write(&format!(
        "{head}{}",
        common::engine_toml(&a.url(), "vllm", 2, 0)
    ));
    assert_eq!(
        admin(&r, http::Method::POST, "/reload", Some(TOKEN), None)
            .await
            .status,
        http::StatusCode::OK
    );
    assert_eq!(engine_origins(&r).await, [(a.url(), "config".to_string())]);
    file.write(&head);
    assert_eq!(
        admin(&r, http::Method::POST, "/reload", Some(TOKEN), None)
            .await
            .status,
        http::StatusCode::OK
    );

    // DNS still answers with its address: within 20 discovery intervals it is back.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    loop {
        let now = engine_origins(&r).await;
        if now == discovered {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "DNS still names {} but the fleet is {now:?}",
            a.url()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(common::chat(r.addr, 2).await.status, http::StatusCode::OK);
    r.shutdown().await;
    drop(server);
}

/// Three ordinary vLLM servers behind one name (the recorded vLLM 0.32, two DP ranks each, at
/// 127.0.0.2-4 on one port), the entry giving only the port and flavor: each server is its own
/// DP deployment, six ranks `ip:port@0`/`@1`, least KV across all six, each pinned with its
/// server's own rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_independent_servers_found_by_dns() {
    use common::recorded::{six_ranks_least_kv, RecordedVllm};
    let mut found = None;
    for _ in 0..20 {
        let a = RecordedVllm::start_on(([127, 0, 0, 2], 0).into(), 0)
            .await
            .unwrap();
        let port = a.addr.port();
        let b = RecordedVllm::start_on(([127, 0, 0, 3], port).into(), 0).await;
        let c = RecordedVllm::start_on(([127, 0, 0, 4], port).into(), 0).await;
        if let (Ok(b), Ok(c)) = (b, c) {
            found = Some(([a, b, c], port));
            break;
        }
    }
    let (servers, port) = found.expect("a port free on 127.0.0.2, .3 and .4");
    let dns = DnsServer::start(Mode::Answer, &["127.0.0.2", "127.0.0.3", "127.0.0.4"]).await;
    let router = dns_router(&dns, port, "flavor = \"vllm\"\n").await;
    six_ranks_least_kv(&router, &servers).await;
    router.shutdown().await;
}
