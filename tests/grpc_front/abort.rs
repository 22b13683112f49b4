//! Abort on the gRPC front door: it reaches the engine holding the id and no other, an unknown id
//! is OK and reaches no engine, and vLLM ids on two engines go each to its own engine.

use prost::Message;
use rankgate::proto::vllm;
use rankgate_sim::sim::SimFlavor as Flavor;

use crate::common::grpc::*;

#[tokio::test]
async fn abort_reaches_the_engine_holding_the_id_and_no_other() {
    for flavor in FLAVORS {
        let (a, b, r) = two_engines(flavor).await;
        let mut c = front(&r, flavor);
        let mut g = c.start("x", None, 100_000).await.unwrap();
        assert_eq!(g.stream.next().await, Some(Ev::Chunk { completion: 1 }));
        let (holder, other, rank) = match (a.generated(), b.generated()) {
            (true, false) => (&a, &b, 0),
            (false, true) => (&b, &a, 1),
            both => panic!("{flavor:?}: Generate reached (a, b) = {both:?}"),
        };
        assert_eq!(g.worker, Some(holder.worker(rank)), "{flavor:?}");

        let success = c.abort("x").await.expect("Abort");
        assert_ne!(success, Some(false), "{flavor:?}: the engine's answer");
        let (reason, tokens) = g.stream.until_complete().await.expect("a final message");
        assert_eq!(reason, "abort", "{flavor:?}");
        assert!(tokens < 100_000);
        assert_eq!(g.stream.next().await, None, "{flavor:?}: the stream ends");
        assert_eq!(holder.sim.aborted(), vec!["x".to_string()], "{flavor:?}");
        assert!(other.sim.aborted().is_empty(), "{flavor:?}");
        assert!(
            other.sim.grpc_seen().iter().all(|s| s.method != "Abort"),
            "{flavor:?}: the other engine was not asked"
        );
        wait_idle(&holder.sim).await;
    }
}

#[tokio::test]
async fn abort_of_an_unknown_id_is_ok_and_reaches_no_engine() {
    for flavor in FLAVORS {
        let (a, b, r) = two_engines(flavor).await;
        let mut c = front(&r, flavor);
        let success = c
            .abort("nobody")
            .await
            .expect("Abort of an unknown id is OK");
        for e in [&a, &b] {
            assert!(e.sim.grpc_seen().is_empty(), "{flavor:?}");
            assert!(e.sim.aborted().is_empty(), "{flavor:?}");
        }
        // SGLang's servicer sends any abort on to its scheduler and answers `success: true`,
        // running or not (so does the simulator); rankgate, answering for the fleet, should not
        // tell the client its abort failed.
        let want = (flavor == Flavor::Sglang).then_some(true);
        assert_eq!(success, want, "{flavor:?}: AbortResponse.success");
    }
}

#[tokio::test]
async fn vllm_abort_of_ids_on_two_engines_sends_each_engine_only_its_own() {
    let flavor = Flavor::Vllm;
    let (a, b, r) = two_engines(flavor).await;
    let mut c = front(&r, flavor);
    // "x" to a (the idler), then "y" to b once b is the idler.
    a.sim.set_kv_usage(vec![0.1]);
    b.sim.set_kv_usage(vec![0.9]);
    wait_kv(&r, &[(0, 0.1), (1, 0.9)]).await;
    let mut x = c.start("x", None, 100_000).await.unwrap();
    assert_eq!(x.worker, Some(a.worker(0)));
    a.sim.set_kv_usage(vec![0.9]);
    b.sim.set_kv_usage(vec![0.1]);
    wait_kv(&r, &[(0, 0.9), (1, 0.1)]).await;
    let mut y = c.start("y", None, 100_000).await.unwrap();
    assert_eq!(y.worker, Some(b.worker(1)));
    for g in [&mut x, &mut y] {
        assert_eq!(g.stream.next().await, Some(Ev::Chunk { completion: 1 }));
    }

    let Client::Vllm(v) = &mut c else {
        unreachable!()
    };
    let ids = ["x", "y", "nobody"].map(String::from).to_vec();
    bounded(v.abort(vllm::AbortRequest { request_ids: ids }))
        .await
        .expect("Abort");
    for (g, e, id) in [(&mut x, &a, "x"), (&mut y, &b, "y")] {
        let (reason, _) = g.stream.until_complete().await.expect("a final message");
        assert_eq!(reason, "abort", "{id}");
        assert_eq!(e.sim.aborted(), vec![id.to_string()]);
        let seen = e.sim.grpc_seen();
        let abort = seen.iter().find(|s| s.method == "Abort").expect("an Abort");
        let sent = vllm::AbortRequest::decode(abort.raw.clone()).unwrap();
        assert_eq!(sent.request_ids, vec![id.to_string()], "only its own id");
    }
}
