//! The discovery task's life and its effect: shutdown or a dropped receiver ends it, a missing
//! kubeconfig is retried until it appears, and pod events change a router's fleet.

use rankgate::config::Config;

use crate::common;
use crate::{fake_api::*, helpers::*};

#[tokio::test]
async fn shutdown_ends_the_task() {
    let api = FakeApi::start(vec![pod("vllm-0", "127.0.0.10", true)]).await;
    let mut w = start(&api);
    assert_eq!(w.next().await, ["http://127.0.0.10:8000"]);
    w.stop.send(true).unwrap();
    tokio::time::timeout(WAIT, w.task)
        .await
        .expect("stopped within the wait")
        .unwrap();
}

#[tokio::test]
async fn a_dropped_receiver_ends_the_task() {
    let api = FakeApi::start(vec![pod("vllm-0", "127.0.0.10", true)]).await;
    let mut w = start(&api);
    assert_eq!(w.next().await, ["http://127.0.0.10:8000"]);
    drop(w.sets);
    tokio::time::timeout(WAIT, w.task)
        .await
        .expect("stopped within the wait")
        .unwrap();
}

#[tokio::test]
async fn a_missing_kubeconfig_is_retried_until_it_appears() {
    let api = FakeApi::start(vec![pod("vllm-0", "127.0.0.10", true)]).await;
    let dir = TempDir::new();
    let path = dir.0.join("kubeconfig");
    let mut w = start_with(&path, dir);
    // The spawned task runs (and fails to read the file) before this test task resumes: the
    // runtime is single-threaded and the yield puts the test behind it.
    tokio::task::yield_now().await;
    assert!(w.sets.try_recv().is_err());
    write_kubeconfig(&path, api.addr);
    assert_eq!(w.next().await, ["http://127.0.0.10:8000"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_events_change_the_routers_fleet() {
    let (a, b, port) = common::engines_on_one_port().await;
    let (ea, eb) = (a.url(), b.url());
    let api = FakeApi::start(vec![
        pod("vllm-0", "127.0.0.2", true),
        pod("vllm-1", "127.0.0.3", false),
    ])
    .await;
    let dir = TempDir::new();
    let kubeconfig = dir.0.join("kubeconfig");
    write_kubeconfig(&kubeconfig, api.addr);
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n{}\
         [[discovery]]\nkind = \"kubernetes\"\nnamespace = \"{NS}\"\nselector = \"{SELECTOR}\"\n\
         port = {port}\nflavor = \"vllm\"\ndp_size = 2\nkubeconfig = {:?}\n",
        common::FAST,
        kubeconfig.display().to_string()
    );
    let router = rankgate::app::Router::start(Config::from_str(&text).unwrap())
        .await
        .unwrap();
    let only = |url: &str| {
        let url = url.to_string();
        move |ids: &[String]| ids.len() == 2 && ids.iter().all(|i| i.starts_with(&url))
    };
    let both = |ids: &[String]| ids.len() == 4;

    // The Ready pod is the fleet; the other joins when it becomes Ready.
    common::wait_available(&router, only(&ea)).await;
    api.apply(pod("vllm-1", "127.0.0.3", true));
    common::wait_available(&router, both).await;

    // Not Ready any more: it leaves, and the requests go to the other.
    api.apply(pod("vllm-0", "127.0.0.2", false));
    common::wait_available(&router, only(&eb)).await;
    assert_eq!(common::workers(&router).await.len(), 2);
    let before = a.requests_received();
    for _ in 0..10 {
        let reply = common::chat(router.addr, 2).await;
        assert_eq!(reply.status, 200);
        assert!(reply.worker().starts_with(&eb), "{}", reply.worker());
    }
    assert_eq!(a.requests_received(), before);

    // The watch expires while vllm-0 becomes Ready again: the re-list brings it back.
    api.expire(Expiry::InStream, |pods| {
        pods.insert("vllm-0".into(), pod("vllm-0", "127.0.0.2", true));
    });
    common::wait_available(&router, both).await;

    // Deleted: gone from the fleet.
    api.delete("vllm-1");
    common::wait_available(&router, only(&ea)).await;
    assert_eq!(common::workers(&router).await.len(), 2);
    assert_eq!(common::chat(router.addr, 2).await.status, 200);
    router.shutdown().await;
}
