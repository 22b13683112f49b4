//! Where the gRPC front door sends calls: Generate to the least-KV rank with the rank set in the
//! message, unknown fields kept and a client's rank replaced, Embed pinned where it has a rank
//! field, a leaving client stopping the engine, deadlines passed through over one shared
//! connection (the next opened at its stream limit), UNAVAILABLE failed over, each front door of
//! a mixed fleet to its own engines, and no debugging header reaching an engine.

use std::time::Duration;

use rankgate::app::Router;
use rankgate::pbwire::set_varint;
use rankgate::proto::vllm;
use rankgate::telemetry::grpc::transport;
use rankgate_sim::sim::SimFlavor as Flavor;
use tonic::Code;

use crate::common;
use crate::common::grpc::*;
use crate::common::*;
use crate::helpers::*;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

#[tokio::test]
async fn generate_goes_to_the_least_kv_rank_with_the_rank_set_in_the_message() {
    for flavor in FLAVORS {
        let (e, r) = low_kv_on_rank_3(flavor).await;
        let mut c = front(&r, flavor);
        let mut g = c.start("g1", None, 5).await.unwrap();
        assert_eq!(g.worker, Some(e.worker(3)), "{flavor:?}");
        assert_eq!(g.stream.all(6).await, complete(5), "{flavor:?}");
        assert_eq!(
            e.sim.served(),
            vec![0, 1],
            "{flavor:?}: local rank 1 is rank 3"
        );
        let seen = e.sim.grpc_seen();
        assert_eq!(seen.len(), 1, "{flavor:?}");
        assert_eq!((seen[0].method, seen[0].rank), ("Generate", Some(3)));
        let want = set_varint(&g.raw, generate_rank_field(flavor), 3).unwrap();
        assert_eq!(
            seen[0].raw, want,
            "{flavor:?}: the message as sent, with the rank field set"
        );
    }
}

#[tokio::test]
async fn unknown_fields_survive_and_a_client_rank_is_replaced() {
    for flavor in FLAVORS {
        let (e, r) = low_kv_on_rank_3(flavor).await;
        // The client asks for rank 2 (rankgate decides: 3), and adds two fields no proto has:
        // 99 (bytes) and 50 (varint).
        let mut raw = generate_bytes(flavor, "raw", Some(2), 3);
        put_varint(&mut raw, 99 << 3 | 2);
        put_varint(&mut raw, 4);
        raw.extend_from_slice(b"\x00\xffok");
        put_varint(&mut raw, 50 << 3);
        put_varint(&mut raw, 300);

        let grpc = r.grpc_addr.unwrap();
        let reply = raw_call(grpc, &method_path(flavor, "Generate"), &raw).await;
        assert_eq!(reply.code, Code::Ok, "{flavor:?}: {}", reply.message);
        assert_eq!(reply.worker(), Some(e.worker(3).as_str()), "{flavor:?}");
        assert_eq!(
            reply.messages.len(),
            4,
            "{flavor:?}: 3 chunks and the final message"
        );

        let seen = e.sim.grpc_seen();
        assert_eq!(seen.len(), 1, "{flavor:?}");
        assert_eq!(seen[0].rank, Some(3), "{flavor:?}");
        let want = set_varint(&raw, generate_rank_field(flavor), 3).unwrap();
        assert_eq!(
            seen[0].raw, want,
            "{flavor:?}: every byte kept but the rank field"
        );
    }
}

#[tokio::test]
async fn embed_is_pinned_where_the_request_has_a_rank_field() {
    for flavor in FLAVORS {
        let (e, r) = low_kv_on_rank_3(flavor).await;
        let mut c = front(&r, flavor);
        assert_eq!(c.embed("e1", 0).await.unwrap(), 8, "{flavor:?}");
        let seen = e.sim.grpc_seen();
        assert_eq!(seen.len(), 1, "{flavor:?}");
        assert_eq!(seen[0].method, "Embed");
        let sent = embed_bytes(flavor, "e1", 0);
        match flavor {
            // SGLang: field 8 set explicitly (even rank 0 would be on the wire).
            Flavor::Sglang => {
                assert_eq!(seen[0].rank, Some(3));
                assert_eq!(seen[0].raw, set_varint(&sent, 8, 3).unwrap());
            }
            // vLLM's EmbedRequest has no rank field: the message passes untouched.
            Flavor::Vllm => assert_eq!(seen[0].raw, sent),
        }
        wait_no_in_flight(&r).await;
    }
}

#[tokio::test]
async fn a_client_that_leaves_stops_the_engine() {
    for flavor in FLAVORS {
        let (e, r) = low_kv_on_rank_3(flavor).await;
        let mut c = front(&r, flavor);
        // 100k tokens at 200/s: only the client leaving ends this within the test.
        let mut g = c.start("gone", None, 100_000).await.unwrap();
        assert_eq!(g.stream.next().await, Some(Ev::Chunk { completion: 1 }));
        assert_eq!(e.sim.running(), vec![0, 1], "{flavor:?}");
        drop(g);
        wait_idle(&e.sim).await;
        wait_no_in_flight(&r).await;
        assert!(e.sim.aborted().is_empty(), "{flavor:?}: a reset, no Abort");
    }
}

/// `n` Generate calls of `tokens` tokens each through rankgate, all started at once, with
/// `metadata`; each must end OK with every chunk.
async fn at_once(
    r: &Router,
    flavor: Flavor,
    n: usize,
    tokens: u32,
    metadata: &'static [(&str, &str)],
) {
    let (grpc, path) = (r.grpc_addr.unwrap(), method_path(flavor, "Generate"));
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..n {
        let (path, raw) = (
            path.clone(),
            generate_bytes(flavor, &format!("c{i}"), None, tokens),
        );
        calls.spawn(async move { raw_call_with(grpc, &path, &raw, metadata).await });
    }
    while let Some(reply) = calls.join_next().await {
        let reply = reply.unwrap();
        assert_eq!(reply.code, Code::Ok, "{flavor:?}: {}", reply.message);
        assert_eq!(reply.messages.len(), tokens as usize + 1, "{flavor:?}");
    }
}

/// The distinct client addresses (connections) the engine's Generate calls came over.
fn connections(e: &Eng) -> usize {
    let mut peers: Vec<_> = e.sim.grpc_seen().iter().map(|s| s.peer).collect();
    peers.sort();
    peers.dedup();
    peers.len()
}

#[tokio::test]
async fn deadlines_pass_through_and_calls_share_one_connection() {
    for flavor in FLAVORS {
        let (e, r) = low_kv_on_rank_3(flavor).await;
        // Eight calls of 60 tokens (300 ms at the simulated 200 tokens/s) overlap: over HTTP/1
        // they would need eight connections.
        at_once(&r, flavor, 8, 60, &[("grpc-timeout", "5S")]).await;
        let seen = e.sim.grpc_seen();
        assert_eq!(seen.len(), 8, "{flavor:?}");
        assert!(
            seen.iter().all(|s| s.timeout.as_deref() == Some("5S")),
            "{flavor:?}: the client's deadline reaches the engine: {:?}",
            seen.iter().map(|s| &s.timeout).collect::<Vec<_>>()
        );
        assert_eq!(
            connections(&e),
            1,
            "{flavor:?}: one h2 connection carries them all"
        );
        wait_no_in_flight(&r).await;
    }
}

#[tokio::test]
async fn a_connection_at_its_stream_limit_opens_the_next() {
    let flavor = Flavor::Vllm;
    let e = Eng::start(flavor, 2, 2).await;
    let extra = format!("grpc_streams_per_connection = 2\n{GRPC_FAST}");
    let r = router(&extra, &[e.toml()]).await;
    wait_state(&r, &[0, 1], "available").await;
    // Five overlapping calls, two streams per connection: three connections.
    at_once(&r, flavor, 5, 60, &[]).await;
    assert_eq!(connections(&e), 3);
}

#[tokio::test]
async fn an_engine_answering_unavailable_is_failed_over() {
    for flavor in FLAVORS {
        let (bad, good) = (
            Eng::start(flavor, 1, 0).await,
            Eng::start(flavor, 1, 1).await,
        );
        bad.sim.set_fail(503, 100.0).unwrap();
        // The failing engine looks idler: it is the pick until its failures count.
        bad.sim.set_kv_usage(vec![0.0]);
        good.sim.set_kv_usage(vec![0.5]);
        let r = grpc_router(&[&bad, &good]).await;
        wait_state(&r, &[0, 1], "available").await;
        at_once(&r, flavor, 6, 2, &[]).await;
        assert!(good.generated(), "{flavor:?}");
        assert!(
            !bad.generated(),
            "{flavor:?}: refused calls leave no record"
        );
        let rows = workers(&r).await;
        assert_eq!(rows[0]["in_flight"], 0, "{flavor:?}");
        assert!(
            rows[0]["consecutive_failures"].as_u64().unwrap_or(0) > 0,
            "{flavor:?}: UNAVAILABLE answers count against the rank: {}",
            rows[0]
        );
    }
}

#[tokio::test]
async fn in_a_mixed_fleet_each_front_door_sends_only_to_its_own_engines() {
    for flavor in FLAVORS {
        // Rank 0: OpenAI HTTP only; rank 1: gRPC only.
        let h = engine(common::sim(flavor, 1, 0)).await;
        let g = Eng::start(flavor, 1, 1).await;
        let r = router(
            GRPC_FAST,
            &[engine_toml(&h.url(), flavor.as_str(), 1, 0), g.toml()],
        )
        .await;
        wait_state(&r, &[0, 1], "available").await;
        wait_workers(&r, Duration::from_secs(10), |rows| {
            rows[0]["models"].as_array().is_some_and(|m| !m.is_empty())
        })
        .await;

        // The gRPC engine looks idle: HTTP still goes to the HTTP engine.
        h.set_kv_usage(vec![0.9]);
        g.sim.set_kv_usage(vec![0.0]);
        wait_kv(&r, &[(0, 0.9), (1, 0.0)]).await;
        for _ in 0..4 {
            let reply = chat(r.addr, 3).await;
            assert_eq!(reply.status, 200, "{flavor:?}: {:?}", reply.body);
            assert_eq!(reply.worker(), format!("{}@0", h.url()), "{flavor:?}");
        }

        // The HTTP engine looks idle: gRPC still goes to the gRPC engine.
        h.set_kv_usage(vec![0.0]);
        g.sim.set_kv_usage(vec![0.9]);
        wait_kv(&r, &[(0, 0.0), (1, 0.9)]).await;
        let mut c = front(&r, flavor);
        for i in 0..4 {
            let mut s = c.start(&format!("m{i}"), None, 2).await.unwrap();
            assert_eq!(s.worker, Some(g.worker(1)), "{flavor:?}");
            assert_eq!(s.stream.all(3).await, complete(2), "{flavor:?}");
        }

        assert_eq!(h.served(), vec![4], "{flavor:?}");
        assert_eq!(g.sim.served(), vec![4], "{flavor:?}");
        assert!(
            g.sim.seen().is_empty(),
            "{flavor:?}: no HTTP to the gRPC engine"
        );
    }
}

/// `x-rankgate-debug` works on the gRPC front door, and neither it nor the admin token reaches
/// an engine: not on a proxied call, not on a call rankgate makes itself (Abort).
#[tokio::test]
async fn the_debugging_headers_never_reach_an_engine() {
    let a = Eng::start(Flavor::Vllm, 1, 0).await;
    let r = grpc_router_with(&common::admin::token_env(), &[a.toml()]).await;
    wait_state(&r, &[0], "available").await;
    let origin: http::Uri = format!("http://{}", r.grpc_addr.unwrap()).parse().unwrap();
    let mut c = vllm::vllm_engine_client::VllmEngineClient::with_origin(
        transport(Duration::from_secs(2)),
        origin,
    );
    fn debugging<T>(msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        let m = req.metadata_mut();
        m.insert("x-rankgate-debug", "1".parse().unwrap());
        m.insert(
            "x-rankgate-admin-token",
            common::admin::TOKEN.parse().unwrap(),
        );
        req
    }
    let resp = bounded(c.generate(debugging(vllm_generate("dbg", None, 100_000))))
        .await
        .expect("Generate");
    let pick = resp
        .metadata()
        .get("x-rankgate-pick")
        .expect("the pick explained");
    assert!(pick.to_str().unwrap().contains("\"policy\":\"least_kv\""));
    let mut stream = resp.into_inner();
    assert!(bounded(stream.message()).await.expect("a chunk").is_some());
    let abort = vllm::AbortRequest {
        request_ids: vec!["dbg".into()],
    };
    bounded(c.abort(debugging(abort))).await.expect("Abort");
    let seen = a.sim.grpc_seen();
    assert!(seen.iter().any(|s| s.method == "Abort"), "{seen:?}");
    for s in &seen {
        assert!(
            !(s.header_names.iter())
                .any(|h| h == "x-rankgate-debug" || h == "x-rankgate-admin-token"),
            "{} reached the engine with {:?}",
            s.method,
            s.header_names
        );
    }
}
