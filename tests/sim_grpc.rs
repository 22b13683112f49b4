//! The simulated engine's gRPC inference calls (`Generate`, `Embed`, `Abort`) over real sockets,
//! for both flavors: rank pinning as the real servicers do it, what the engine records of each
//! call, and generations that end early by abort or by a client that leaves.

mod common;

use common::grpc::*;
use common::*;
use rankgate_sim::sim::{SimEngine, SimFlavor as Flavor};
use tonic::Code;

/// An engine of 2 ranks numbered 2 and 3, its gRPC side started, and a client for it.
async fn grpc_engine(flavor: Flavor) -> (SimEngine, Client) {
    let e = engine(sim(flavor, 2, 2)).await;
    let g = e.start_grpc(loopback()).await.expect("start gRPC");
    (e, Client::connect(flavor, g))
}

#[tokio::test]
async fn generate_streams_from_the_pinned_rank() {
    for flavor in FLAVORS {
        let (e, mut c) = grpc_engine(flavor).await;
        let (mut s, raw) = c.generate("g1", Some(3), 5).await.unwrap();
        let mut events = Vec::new();
        while let Some(ev) = s.next().await {
            events.push(ev);
            assert!(events.len() <= 6, "{flavor:?}: too many events {events:?}");
        }
        let mut want: Vec<Ev> = (1..=5).map(|completion| Ev::Chunk { completion }).collect();
        want.push(Ev::Complete {
            reason: "length".into(),
            tokens: 5,
        });
        assert_eq!(events, want, "{flavor:?}");
        assert_eq!(
            e.served(),
            vec![0, 1],
            "{flavor:?}: local rank 1 is global 3"
        );
        let seen = e.grpc_seen();
        assert_eq!(seen.len(), 1, "{flavor:?}");
        assert_eq!(seen[0].method, "Generate");
        assert_eq!(seen[0].rank, Some(3));
        assert_eq!(seen[0].raw, raw, "{flavor:?}: the message as sent");

        // No rank: the engine picks its least loaded rank (both idle: the first).
        let (mut s, _) = c.generate("g2", None, 2).await.unwrap();
        while s.next().await.is_some() {}
        assert_eq!(e.grpc_seen()[1].rank, Some(2), "{flavor:?}");
    }
}

#[tokio::test]
async fn out_of_range_rank_is_invalid_argument() {
    for flavor in FLAVORS {
        let (e, mut c) = grpc_engine(flavor).await;
        for rank in [0, 1, 4, -1] {
            let err = match c.generate("bad", Some(rank), 3).await {
                Ok(_) => panic!("{flavor:?}: rank {rank} accepted"),
                Err(err) => err,
            };
            assert_eq!(err.code(), Code::InvalidArgument, "{flavor:?} {rank}");
            assert!(
                err.message().contains(&rank.to_string()) && err.message().contains("[2, 4)"),
                "{flavor:?}: {}",
                err.message()
            );
        }
        if flavor == Flavor::Sglang {
            let err = c.embed("bad", 9).await.unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument);
            assert!(err.message().contains("9"), "{}", err.message());
        }
        assert!(
            e.grpc_seen().is_empty(),
            "{flavor:?}: a refused rank leaves no record"
        );
        assert_eq!(e.served(), vec![0, 0]);
    }
}

#[tokio::test]
async fn embed_answers() {
    for flavor in FLAVORS {
        let (e, mut c) = grpc_engine(flavor).await;
        assert_eq!(c.embed("e1", 3).await.unwrap(), 8, "{flavor:?}");
        let seen = e.grpc_seen();
        assert_eq!(seen[0].method, "Embed");
        // SGLang pins by the request's rank; vLLM's request has none, so the engine balances.
        let want = if flavor == Flavor::Sglang { 3 } else { 2 };
        assert_eq!(seen[0].rank, Some(want), "{flavor:?}");
        assert_eq!(e.served().iter().sum::<u64>(), 1);
    }
}

#[tokio::test]
async fn abort_ends_a_running_stream() {
    for flavor in FLAVORS {
        let (e, mut c) = grpc_engine(flavor).await;
        // 100k tokens at 200/s: only an abort ends this within the test.
        let (mut s, _) = c.generate("long", Some(2), 100_000).await.unwrap();
        assert_eq!(s.next().await, Some(Ev::Chunk { completion: 1 }));
        // SGLang's answer says whether it aborted; vLLM's is empty.
        let success = (flavor == Flavor::Sglang).then_some(true);
        assert_eq!(c.abort("long").await.unwrap(), success, "{flavor:?}");
        let end = s.until_complete().await;
        let (reason, tokens) = end.expect("a final message");
        assert_eq!(reason, "abort", "{flavor:?}");
        assert!(tokens < 100_000);
        assert_eq!(s.next().await, None, "{flavor:?}: the stream ends");
        assert_eq!(e.aborted(), vec!["long".to_string()]);
        let seen = e.grpc_seen();
        assert_eq!(
            seen.last().map(|s| (s.method, s.rank)),
            Some(("Abort", None))
        );
        wait_idle(&e).await;
    }
}

#[tokio::test]
async fn dropping_the_client_stream_stops_generation() {
    for flavor in FLAVORS {
        let (e, mut c) = grpc_engine(flavor).await;
        let (mut s, _) = c.generate("gone", Some(3), 100_000).await.unwrap();
        assert_eq!(s.next().await, Some(Ev::Chunk { completion: 1 }));
        assert_eq!(e.running(), vec![0, 1], "{flavor:?}");
        drop(s);
        wait_idle(&e).await;
        assert!(
            e.kv_usage().iter().all(|&u| u == 0.0),
            "{flavor:?}: KV freed"
        );
    }
}
