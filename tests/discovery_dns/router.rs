//! DNS discovery in a router: records added and removed change its fleet, an engine the file
//! drops again returns to discovery, and three independent servers are found by DNS.

use std::time::Duration;

use rankgate::config::Config;

use crate::common;
use crate::common::admin::{admin, token_env, TempConfig, TOKEN};
use crate::{dns_server::*, helpers::*};

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
