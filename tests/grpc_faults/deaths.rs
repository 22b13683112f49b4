//! Engines that die or keep failing behind the gRPC front door: an engine killed mid-stream ends
//! the client's stream UNAVAILABLE naming the worker (in the trailers when the headers went out), a
//! port that refuses connections is retried on the other engine, and an engine whose calls or
//! streams end UNAVAILABLE is ejected like one answering 503 over HTTP.

use http_body_util::BodyExt;
use rankgate_sim::sim::SimFlavor as Flavor;
use tonic::Code;

use crate::common::grpc::*;
use crate::common::*;
use crate::helpers::*;

#[tokio::test]
async fn an_engine_killed_mid_stream_ends_it_unavailable_naming_the_worker() {
    for flavor in FLAVORS {
        let (a, b, r) = two_engines(flavor).await;
        // a is the idler: the stream goes there.
        a.sim.set_kv_usage(vec![0.1]);
        b.sim.set_kv_usage(vec![0.9]);
        wait_kv(&r, &[(0, 0.1), (1, 0.9)]).await;
        let mut c = front(&r, flavor);
        let mut g = c.start("doomed", None, 100_000).await.unwrap();
        assert_eq!(g.worker, Some(a.worker(0)), "{flavor:?}");
        assert_eq!(g.stream.next().await, Some(Ev::Chunk { completion: 1 }));

        a.sim.kill().await;
        let (_, status) = until_failure(&mut g.stream, 10_000).await;
        assert_eq!(status.code(), Code::Unavailable, "{flavor:?}: {status:?}");
        assert!(
            status.message().contains(&a.worker(0)),
            "{flavor:?}: the status names the worker: {status:?}"
        );
        wait_no_in_flight(&r).await;

        // At once, before telemetry says a is gone: b serves the next call.
        assert_eq!(
            good_generate(&r, flavor, "after").await,
            b.worker(1),
            "{flavor:?}"
        );
        assert!(b.generated(), "{flavor:?}");
        wait_no_in_flight(&r).await;
    }
}

#[tokio::test]
async fn a_killed_stream_ends_with_the_status_in_its_trailers() {
    // The wire under the status above: HTTP 200 and the messages sent before, then trailers.
    let flavor = Flavor::Sglang;
    let e = Eng::start(flavor, 1, 0).await;
    let r = grpc_router(&[&e]).await;
    wait_state(&r, &[0], "available").await;
    let (parts, body) = long_generate(&r, flavor, "dies").await;

    e.sim.kill().await;
    let rest = bounded(body.collect())
        .await
        .expect("the rest, then trailers");
    let trailers = rest.trailers().expect("trailers").clone();
    assert!(
        !parts.headers.contains_key("grpc-status"),
        "not trailers-only"
    );
    assert_eq!(trailers["grpc-status"], "14", "UNAVAILABLE: {trailers:?}");
    let message = trailers["grpc-message"].to_str().unwrap().to_string();
    assert!(message.contains(&e.worker(0)), "{message}");
    assert!(message.contains("broke"), "{message}");
    wait_no_in_flight(&r).await;
}

#[tokio::test]
async fn an_engine_that_answers_every_call_unavailable_is_ejected() {
    for flavor in FLAVORS {
        // Engine 0 looks idlest (its telemetry, from a simulated engine, says KV 0.1) and
        // answers every call UNAVAILABLE at once, as a servicer whose scheduler died does: over
        // HTTP that is a 503, which counts against the rank until it is ejected.
        let tele = Eng::start(flavor, 1, 0).await;
        let failing = FaultyEngine::start(flavor, Fault::Status(Code::Unavailable)).await;
        let b = Eng::start(flavor, 1, 1).await;
        tele.sim.set_kv_usage(vec![0.1]);
        b.sim.set_kv_usage(vec![0.9]);
        let cfg = format!("{GRPC_FAST}[routing]\neject_after = 2\n");
        let r = router(&cfg, &[failing.toml(&tele), b.toml()]).await;
        wait_state(&r, &[0, 1], "available").await;
        wait_kv(&r, &[(0, 0.1), (1, 0.9)]).await;

        let (grpc, path) = (r.grpc_addr.unwrap(), method_path(flavor, "Generate"));
        let mut replies = Vec::new();
        for i in 0..6 {
            let raw = generate_bytes(flavor, &format!("u{i}"), None, 3);
            let reply = raw_call(grpc, &path, &raw).await;
            replies.push((reply.code, reply.worker().map(str::to_string)));
        }
        let rows = workers(&r).await;
        assert!(
            failing.calls() <= 2,
            "{flavor:?}: with routing.eject_after = 2 the failing engine got {} of 6 calls \
             (consecutive_failures {}): replies {replies:?}",
            failing.calls(),
            rows[0]["consecutive_failures"]
        );
        for (code, worker) in &replies[2..] {
            assert_eq!(*code, Code::Ok, "{flavor:?}: {replies:?}");
            assert_eq!(worker.as_deref(), Some(b.worker(1).as_str()), "{flavor:?}");
        }
    }
}

#[tokio::test]
async fn an_engine_whose_streams_end_unavailable_is_ejected() {
    for flavor in FLAVORS {
        // As above, but each call gets two chunks before its UNAVAILABLE: too late to retry,
        // still a failure of the rank.
        let tele = Eng::start(flavor, 1, 0).await;
        let failing = FaultyEngine::start(flavor, Fault::FailAfter(2, Code::Unavailable)).await;
        let b = Eng::start(flavor, 1, 1).await;
        tele.sim.set_kv_usage(vec![0.1]);
        b.sim.set_kv_usage(vec![0.9]);
        let cfg = format!("{GRPC_FAST}[routing]\neject_after = 2\n");
        let r = router(&cfg, &[failing.toml(&tele), b.toml()]).await;
        wait_state(&r, &[0, 1], "available").await;
        wait_kv(&r, &[(0, 0.1), (1, 0.9)]).await;

        let (grpc, path) = (r.grpc_addr.unwrap(), method_path(flavor, "Generate"));
        let mut replies = Vec::new();
        for i in 0..6 {
            let raw = generate_bytes(flavor, &format!("m{i}"), None, 3);
            let reply = raw_call(grpc, &path, &raw).await;
            replies.push((
                reply.code,
                reply.messages.len(),
                reply.worker().map(str::to_string),
            ));
        }
        assert_eq!(
            failing.calls(),
            2,
            "{flavor:?}: ejected after two: {replies:?}"
        );
        assert_eq!(
            replies[0].0,
            Code::Unavailable,
            "{flavor:?}: the engine's own status"
        );
        assert_eq!(replies[0].1, 2, "{flavor:?}: after its two chunks");
        for (code, _, worker) in &replies[2..] {
            assert_eq!(*code, Code::Ok, "{flavor:?}: {replies:?}");
            assert_eq!(worker.as_deref(), Some(b.worker(1).as_str()), "{flavor:?}");
        }
    }
}

#[tokio::test]
async fn a_port_that_refuses_connections_is_retried_on_the_other_engine() {
    for flavor in FLAVORS {
        // Engine 0 reports (through a simulated engine's GetLoads) the lowest KV, but its
        // grpc_url refuses connections: the first attempt goes there and fails to connect.
        let tele = Eng::start(flavor, 1, 0).await;
        let b = Eng::start(flavor, 1, 1).await;
        let dead = refusing_port().await;
        tele.sim.set_kv_usage(vec![0.1]);
        b.sim.set_kv_usage(vec![0.9]);
        let r = router(GRPC_FAST, &[faulty_toml(dead, flavor, &tele), b.toml()]).await;
        wait_state(&r, &[0, 1], "available").await;
        wait_kv(&r, &[(0, 0.1), (1, 0.9)]).await;

        assert_eq!(
            good_generate(&r, flavor, "retried").await,
            b.worker(1),
            "{flavor:?}"
        );
        assert_eq!(
            r.metrics.retries_total(),
            1,
            "{flavor:?}: the first attempt went to the refusing port"
        );
        assert!(b.generated(), "{flavor:?}");
        wait_no_in_flight(&r).await;
    }
}
