//! What the DNS discovery task makes of its server's answers: records that come and go are engines
//! that join and leave, the first answer is reported even when empty, AAAA records are engines with
//! bracketed URLs, SERVFAIL, one failing family or a silent server keep the fleet, and shutdown or
//! a dropped receiver stops the task (even mid-lookup).

use std::net::SocketAddr;
use std::time::Duration;

use rankgate::config::Config;
use rankgate::discovery::dns;
use rankgate::worker::Engine;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::{dns_server::*, helpers::*};

struct Discovery {
    pub sets: mpsc::Receiver<Vec<Engine>>,
    pub shutdown: watch::Sender<bool>,
    pub task: JoinHandle<()>,
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
    pub async fn next(&mut self) -> Vec<String> {
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
