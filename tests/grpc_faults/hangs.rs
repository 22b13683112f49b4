//! Engines that hang or go quiet behind the gRPC front door: DEADLINE_EXCEEDED after
//! `server.response_timeout`, or in the trailers after `server.stream_idle_timeout` once the chunks
//! sent are through, and a client that gives up cancels the engine's call.

use std::time::{Duration, Instant};

use http::StatusCode;
use tonic::Code;

use crate::common::grpc::*;
use crate::common::*;
use crate::helpers::*;

#[tokio::test]
async fn a_hung_engine_is_deadline_exceeded_after_the_response_timeout() {
    for flavor in FLAVORS {
        let tele = Eng::start(flavor, 1, 0).await;
        let hung = FaultyEngine::start(flavor, Fault::Hang).await;
        let r = grpc_router_with("response_timeout = \"300ms\"", &[hung.toml(&tele)]).await;
        wait_state(&r, &[0], "available").await;

        let started = Instant::now();
        let err = match front(&r, flavor).start("hung", None, 3).await {
            Ok(s) => panic!("{flavor:?}: answered by {:?}", s.worker),
            Err(err) => err,
        };
        let took = started.elapsed();
        assert_eq!(err.code(), Code::DeadlineExceeded, "{flavor:?}: {err:?}");
        assert!(
            err.message().contains(&hung.worker(0)),
            "{flavor:?}: names the worker: {err:?}"
        );
        assert!(
            err.message().contains("response_timeout"),
            "{flavor:?}: {err:?}"
        );
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(5),
            "{flavor:?}: after {took:?}"
        );
        assert_eq!(
            hung.calls(),
            1,
            "{flavor:?}: a response timeout is not retried"
        );
        wait_no_in_flight(&r).await;
        hung.wait_all_closed().await;
    }
}

#[tokio::test]
async fn a_stream_that_stalls_ends_deadline_exceeded_after_its_chunks() {
    for flavor in FLAVORS {
        let tele = Eng::start(flavor, 1, 0).await;
        let stalled = FaultyEngine::start(flavor, Fault::StallAfter(3)).await;
        let r = grpc_router_with("stream_idle_timeout = \"300ms\"", &[stalled.toml(&tele)]).await;
        wait_state(&r, &[0], "available").await;

        let mut g = front(&r, flavor).start("quiet", None, 10).await.unwrap();
        assert_eq!(g.worker, Some(stalled.worker(0)), "{flavor:?}");
        let (events, status) = until_failure(&mut g.stream, 3).await;
        let three: Vec<Ev> = (1..=3).map(|completion| Ev::Chunk { completion }).collect();
        assert_eq!(
            events, three,
            "{flavor:?}: the chunks sent before the stall"
        );
        assert_eq!(
            status.code(),
            Code::DeadlineExceeded,
            "{flavor:?}: {status:?}"
        );
        assert!(
            status.message().contains(&stalled.worker(0))
                && status.message().contains("stream_idle_timeout"),
            "{flavor:?}: {status:?}"
        );
        wait_no_in_flight(&r).await;
        stalled.wait_all_closed().await;

        // On the wire: HTTP 200, the three messages, then the status in the trailers.
        let raw = generate_bytes(flavor, "quiet-raw", None, 10);
        let reply = raw_call(r.grpc_addr.unwrap(), &method_path(flavor, "Generate"), &raw).await;
        assert_eq!(reply.http, StatusCode::OK, "{flavor:?}");
        assert_eq!(reply.messages.len(), 3, "{flavor:?}: {reply:?}");
        assert_eq!(reply.code, Code::DeadlineExceeded, "{flavor:?}: {reply:?}");
        assert!(
            !reply.headers.contains_key("grpc-status"),
            "{flavor:?}: the status comes in the trailers, after the messages"
        );
        wait_no_in_flight(&r).await;
        stalled.wait_all_closed().await;
    }
}

#[tokio::test]
async fn a_client_that_gives_up_on_a_hung_engine_cancels_the_engines_call() {
    for flavor in FLAVORS {
        let tele = Eng::start(flavor, 1, 0).await;
        let hung = FaultyEngine::start(flavor, Fault::Hang).await;
        // The default response timeout (30 min): only the client leaving ends this call.
        let r = router(GRPC_FAST, &[hung.toml(&tele)]).await;
        wait_state(&r, &[0], "available").await;
        let (grpc, path) = (r.grpc_addr.unwrap(), method_path(flavor, "Generate"));
        let raw = generate_bytes(flavor, "impatient", None, 3);
        let call = tokio::spawn(async move { raw_call(grpc, &path, &raw).await });
        until("the engine has the call", Duration::from_secs(10), || {
            hung.calls() == 1
        })
        .await;
        wait_workers(&r, Duration::from_secs(10), |rows| {
            rows[0]["in_flight"] == 1
        })
        .await;

        call.abort();
        hung.wait_all_closed().await;
        wait_no_in_flight(&r).await;
    }
}
