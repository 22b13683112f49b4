//! The gRPC front door's guards and its shutdown: `server.max_in_flight` and client API keys hold,
//! a shutdown lets a stream in flight finish and refuses new connections, and a stream that
//! outlives the drain grace ends UNAVAILABLE in its trailers.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use rankgate_sim::sim::SimFlavor as Flavor;
use tonic::Code;

use crate::common::grpc::*;
use crate::common::*;
use crate::helpers::*;

#[tokio::test]
async fn max_in_flight_refuses_a_second_call_until_the_first_ends() {
    for flavor in FLAVORS {
        let e = Eng::start(flavor, 1, 0).await;
        let r = grpc_router_with("max_in_flight = 1", &[e.toml()]).await;
        wait_state(&r, &[0], "available").await;
        let mut c = front(&r, flavor);
        let mut first = c.start("first", None, 100_000).await.unwrap();
        assert_eq!(first.stream.next().await, Some(Ev::Chunk { completion: 1 }));

        let err = match front(&r, flavor).start("second", None, 3).await {
            Ok(s) => panic!("{flavor:?}: second started on {:?}", s.worker),
            Err(err) => err,
        };
        assert_eq!(err.code(), Code::ResourceExhausted, "{flavor:?}: {err:?}");
        assert!(err.message().contains("max_in_flight"), "{err:?}");

        // Abort is rankgate's own call: it is served at the cap and ends the first stream.
        c.abort("first").await.expect("Abort at the cap");
        let (reason, _) = first
            .stream
            .until_complete()
            .await
            .expect("a final message");
        assert_eq!(reason, "abort", "{flavor:?}");
        assert_eq!(first.stream.next().await, None, "{flavor:?}: ends OK");
        wait_no_in_flight(&r).await;

        assert_eq!(good_generate(&r, flavor, "third").await, e.worker(0));
        let generates = e
            .sim
            .grpc_seen()
            .iter()
            .filter(|s| s.method == "Generate")
            .count();
        assert_eq!(
            generates, 2,
            "{flavor:?}: the refused call never reached the engine"
        );
    }
}

#[tokio::test]
async fn client_api_keys_guard_the_grpc_front_door() {
    let var = format!("RANKGATE_GRPC_FAULTS_KEYS_{}", std::process::id());
    std::env::set_var(&var, "key-one, key-two");
    for flavor in FLAVORS {
        let e = Eng::start(flavor, 1, 0).await;
        let r = grpc_router_with(&format!("api_keys_env = \"{var}\""), &[e.toml()]).await;
        wait_state(&r, &[0], "available").await;
        let grpc = r.grpc_addr.unwrap();
        let path = method_path(flavor, "Generate");
        let raw = generate_bytes(flavor, "keyed", None, 3);

        for (what, metadata) in [
            ("no key", vec![]),
            ("wrong key", vec![("authorization", "Bearer key-three")]),
            ("not bearer", vec![("authorization", "Basic a2V5LW9uZQ==")]),
        ] {
            let reply = raw_call_with(grpc, &path, &raw, &metadata).await;
            assert_eq!(
                reply.code,
                Code::Unauthenticated,
                "{flavor:?} {what}: {reply:?}"
            );
            assert!(!reply.message.is_empty(), "{flavor:?} {what}");
        }
        // The tonic client sends no key: refused the same way.
        let err = match front(&r, flavor).start("tonic", None, 3).await {
            Ok(_) => panic!("{flavor:?}: served without a key"),
            Err(err) => err,
        };
        assert_eq!(err.code(), Code::Unauthenticated, "{flavor:?}: {err:?}");
        assert!(
            e.sim.grpc_seen().is_empty(),
            "{flavor:?}: no call without a key"
        );

        let reply = raw_call_with(grpc, &path, &raw, &[("authorization", "Bearer key-two")]).await;
        assert_eq!(reply.code, Code::Ok, "{flavor:?}: {reply:?}");
        assert_eq!(
            reply.messages.len(),
            4,
            "{flavor:?}: 3 chunks and the final message"
        );
        assert_eq!(reply.worker(), Some(e.worker(0).as_str()));
        wait_no_in_flight(&r).await;
    }
}

#[tokio::test]
async fn shutdown_lets_a_stream_in_flight_finish_and_refuses_new_connections() {
    for flavor in FLAVORS {
        let e = Eng::start(flavor, 1, 0).await;
        let r = grpc_router_with("drain_grace = \"10s\"", &[e.toml()]).await;
        wait_state(&r, &[0], "available").await;
        let grpc = r.grpc_addr.unwrap();
        let mut c = front(&r, flavor);
        // 300 tokens at 200/s: the stream outlasts the checks below.
        let mut g = c.start("draining", None, 300).await.unwrap();
        assert_eq!(g.stream.next().await, Some(Ev::Chunk { completion: 1 }));

        let shutdown = tokio::spawn(r.shutdown());
        until_refused(grpc).await;
        let late = Client::connect(flavor, grpc).start("late", None, 3).await;
        match late {
            Ok(s) => panic!("{flavor:?}: a new connection was served by {:?}", s.worker),
            Err(err) => assert!(
                format!("{err:?}").contains("ConnectionRefused"),
                "{flavor:?}: {err:?}"
            ),
        }
        assert!(!shutdown.is_finished(), "{flavor:?}: draining the stream");

        let rest = g.stream.all(300).await;
        assert_eq!(
            rest.len(),
            300,
            "{flavor:?}: chunks 2..=300 and the final message"
        );
        assert_eq!(
            rest.last(),
            Some(&Ev::Complete {
                reason: "length".into(),
                tokens: 300
            }),
            "{flavor:?}"
        );
        bounded(shutdown).await.expect("shutdown");
        wait_idle(&e.sim).await;
    }
}

/// A stream that outlives the drain grace ends with a status, as every gRPC call must: HTTP 200,
/// the messages sent before, then trailers saying UNAVAILABLE because rankgate is shutting down.
#[tokio::test]
async fn a_stream_outliving_the_drain_grace_ends_unavailable_in_its_trailers() {
    let flavor = Flavor::Vllm;
    let e = Eng::start(flavor, 1, 0).await;
    let r = grpc_router_with("drain_grace = \"300ms\"", &[e.toml()]).await;
    wait_state(&r, &[0], "available").await;
    let (_, body) = long_generate(&r, flavor, "outlives").await;

    let shutdown = tokio::spawn(r.shutdown());
    let rest = bounded(body.collect())
        .await
        .expect("the rest, then trailers");
    let trailers = rest.trailers().expect("trailers").clone();
    assert_eq!(trailers["grpc-status"], "14", "UNAVAILABLE: {trailers:?}");
    let message = trailers["grpc-message"].to_str().unwrap();
    assert!(message.contains("shutting down"), "{message}");
    bounded(shutdown).await.expect("shutdown");
    wait_idle(&e.sim).await;
}

/// Waits (bounded) until connecting to `addr` is refused.
async fn until_refused(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::net::TcpStream::connect(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return,
            other => {
                assert!(
                    Instant::now() < deadline,
                    "still accepting after 10 s: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}
