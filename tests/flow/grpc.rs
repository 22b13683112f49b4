//! The gRPC front door queues as the HTTP one does: a `Generate` call that finds the rank busy
//! waits, is sent when it frees, and past its wait gets UNAVAILABLE naming why.

use std::time::Duration;

use tonic::Code;

use super::*;
use crate::common::grpc::*;

#[tokio::test]
async fn a_generate_call_waits_for_the_rank_or_is_refused_past_its_wait() {
    let e = engine(slow()).await;
    let grpc = e.start_grpc(loopback()).await.unwrap();
    let r = router(
        &format!("grpc_listen = \"127.0.0.1:0\"\n{FAST}{FLOW}"),
        &[grpc_toml(grpc, Flavor::Vllm, 1, 0)],
    )
    .await;
    wait_state(&r, &[0], "available").await;
    let mut client = front(&r, Flavor::Vllm);
    let (mut blocker, _) = client.generate("blocker", None, 10).await.unwrap();
    wait_workers(&r, Duration::from_secs(5), |rows| rows[0]["in_flight"] == 1).await;
    let addr = r.grpc_addr.unwrap();
    let path = method_path(Flavor::Vllm, "Generate");
    let late = {
        let (path, msg) = (path.clone(), generate_bytes(Flavor::Vllm, "late", None, 1));
        tokio::spawn(async move {
            raw_call_with(addr, &path, &msg, &[("x-rankgate-max-wait-ms", "200")]).await
        })
    };
    waiting(&r, 1).await;
    let late = late.await.unwrap();
    assert_eq!(late.code, Code::Unavailable, "{late:?}");
    assert!(late.message.contains("saturated"), "{late:?}");
    let queued = {
        let msg = generate_bytes(Flavor::Vllm, "queued", None, 1);
        tokio::spawn(async move { raw_call(addr, &path, &msg).await })
    };
    waiting(&r, 1).await;
    assert!(blocker.until_complete().await.is_some());
    let queued = queued.await.unwrap();
    assert_eq!(queued.code, Code::Ok, "{queued:?}");
    // The call refused in the queue never reached the engine.
    let generated = (e.grpc_seen().iter())
        .filter(|s| s.method == "Generate")
        .count();
    assert_eq!(generated, 2);
}
