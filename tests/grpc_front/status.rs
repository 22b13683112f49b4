//! What the gRPC front door says of itself and its fleet: UNAVAILABLE with no routable rank (a dead
//! engine, a refusing port), GetLoads from the snapshot per rank, UNIMPLEMENTED for a method it
//! does not serve, Health SERVING while a rank is routable, and a fleet of gRPC-only engines ready.

use std::time::Duration;

use rankgate::app::Router;
use rankgate::proto::health::health_check_response::ServingStatus;
use rankgate::proto::health::health_client::HealthClient;
use rankgate::proto::health::HealthCheckRequest;
use rankgate::telemetry::grpc::transport;
use rankgate_sim::sim::SimFlavor as Flavor;
use tonic::{Code, Status};

use crate::common::grpc::*;
use crate::common::*;
use crate::helpers::*;

/// The error a generation that must not start gets.
async fn refused(c: &mut Client, id: &str) -> Status {
    match c.start(id, None, 3).await {
        Ok(s) => panic!("{id}: started on {:?}", s.worker),
        Err(err) => err,
    }
}

#[tokio::test]
async fn a_dead_engine_leaves_no_routable_rank_unavailable() {
    for flavor in FLAVORS {
        let e = Eng::start(flavor, 1, 0).await;
        let r = grpc_router(&[&e]).await;
        wait_state(&r, &[0], "available").await;
        e.sim.kill().await;
        wait_state(&r, &[0], "unavailable").await;
        let err = refused(&mut front(&r, flavor), "late").await;
        assert_eq!(err.code(), Code::Unavailable, "{flavor:?}: {err:?}");
        assert!(!err.message().is_empty(), "{flavor:?}");
    }
}

#[tokio::test]
async fn an_engine_port_that_refuses_connections_is_unavailable() {
    for flavor in FLAVORS {
        let port = refusing_port().await;
        let r = router(GRPC_FAST, &[grpc_toml(port, flavor, 1, 0)]).await;
        wait_state(&r, &[0], "unavailable").await;
        let err = refused(&mut front(&r, flavor), "nowhere").await;
        assert_eq!(err.code(), Code::Unavailable, "{flavor:?}: {err:?}");
        assert!(!err.message().is_empty(), "{flavor:?}");
    }
}

#[tokio::test]
async fn get_loads_answers_from_the_snapshot_per_rank() {
    for flavor in FLAVORS {
        let (_e, r) = low_kv_on_rank_3(flavor).await;
        let mut c = front(&r, flavor);
        let close = |got: &[(i32, f64)], want: &[(i32, f64)]| {
            got.len() == want.len()
                && got
                    .iter()
                    .zip(want)
                    .all(|(g, w)| g.0 == w.0 && (g.1 - w.1).abs() < 1e-9)
        };

        let mut all = c.get_loads(None).await.unwrap();
        all.ranks.sort_by_key(|l| l.0);
        assert_eq!(all.dp_rank_count, 2, "{flavor:?}");
        assert!(
            close(&all.ranks, &[(2, 0.8), (3, 0.1)]),
            "{flavor:?}: {all:?}"
        );

        let one = c.get_loads(Some(3)).await.unwrap();
        assert_eq!(one.dp_rank_count, 1, "{flavor:?}");
        assert!(close(&one.ranks, &[(3, 0.1)]), "{flavor:?}: {one:?}");

        // 0 is sent explicitly (proto3 `optional`): a filter, not "every rank".
        for bad in [0, 7, -1] {
            let err = c.get_loads(Some(bad)).await.unwrap_err();
            assert_eq!(
                err.code(),
                Code::InvalidArgument,
                "{flavor:?} {bad}: {err:?}"
            );
            assert!(
                err.message().contains(&bad.to_string()),
                "{}",
                err.message()
            );
        }
    }
}

#[tokio::test]
async fn a_method_rankgate_does_not_serve_is_unimplemented() {
    for flavor in FLAVORS {
        let e = Eng::start(flavor, 1, 0).await;
        let r = grpc_router(&[&e]).await;
        wait_state(&r, &[0], "available").await;
        let path = method_path(flavor, "StartProfile");
        let reply = raw_call(r.grpc_addr.unwrap(), &path, &[]).await;
        assert_eq!(reply.code, Code::Unimplemented, "{flavor:?}: {reply:?}");
        assert!(reply.message.contains("StartProfile"), "{}", reply.message);
        assert!(reply.messages.is_empty());
        assert!(e.sim.grpc_seen().is_empty(), "{flavor:?}");
    }
}

/// `grpc.health.v1.Health/Check` on rankgate.
async fn check(r: &Router, service: &str) -> Result<i32, Status> {
    let origin: http::Uri = format!("http://{}", r.grpc_addr.unwrap()).parse().unwrap();
    let mut h = HealthClient::with_origin(transport(Duration::from_secs(2)), origin);
    let req = HealthCheckRequest {
        service: service.into(),
    };
    Ok(bounded(h.check(req)).await?.into_inner().status)
}

#[tokio::test]
async fn health_is_serving_while_a_rank_is_routable() {
    let e = Eng::start(Flavor::Vllm, 1, 0).await;
    let r = grpc_router(&[&e]).await;
    wait_state(&r, &[0], "available").await;
    let (serving, not) = (
        ServingStatus::Serving as i32,
        ServingStatus::NotServing as i32,
    );
    assert_eq!(check(&r, "").await.unwrap(), serving);
    assert_eq!(check(&r, service(Flavor::Vllm)).await.unwrap(), serving);
    // No SGLang engine in this fleet.
    assert_eq!(check(&r, service(Flavor::Sglang)).await.unwrap(), not);
    let err = check(&r, "no.such.Service").await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");

    e.sim.kill().await;
    wait_state(&r, &[0], "unavailable").await;
    assert_eq!(check(&r, "").await.unwrap(), not);
}

/// A fleet of gRPC-only engines is served through the gRPC front door alone, so `/ready` (what
/// a Kubernetes readiness probe reads) says 200 once a rank is routable there: the OpenAI front
/// door having no engine must not keep the router out of its Service.
#[tokio::test]
async fn a_fleet_of_grpc_only_engines_is_ready() {
    let a = Eng::start(Flavor::Sglang, 2, 0).await;
    let r = grpc_router_with("", &[a.toml()]).await;
    wait_state(&r, &[0, 1], "available").await;
    let ready = get(r.admin_addr, "/ready").await;
    assert_eq!(
        ready.status,
        http::StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&ready.body)
    );
    r.shutdown().await;
}

/// `rankgate grpc-client` under the default `expose_worker = "none"`: with the admin token the
/// call names the rank that served it; without it the tool says the router hides the rank,
/// not that the call went around rankgate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_client_names_the_rank_with_the_admin_token() {
    use crate::common::admin::{token_env, TOKEN};
    let e = Eng::start(Flavor::Vllm, 1, 0).await;
    let server = format!("expose_worker = \"none\"\n{}", token_env());
    let r = router_with(&server, GRPC_FAST, &[e.toml()]).await;
    wait_state(&r, &[0], "available").await;
    let url = format!("http://{}", r.grpc_addr.expect("grpc_listen"));
    let run = |token| {
        let args = [
            "grpc-client",
            "--flavor",
            "vllm",
            "--max-tokens",
            "2",
            "--url",
            &url,
        ];
        crate::common::binary::run_tool(args.map(String::from).to_vec(), token)
    };
    let o = run(Some(TOKEN)).await;
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains(&format!("served by {}", e.worker(0))), "{out}");

    let o = run(None).await;
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("served by (hidden by the router"), "{out}");
    assert!(!out.contains(&e.worker(0)), "{out}");
    r.shutdown().await;
}
