//! The deployment run for real: a router started from the ConfigMap's config answers the probes
//! and drains as the manifests expect; the alert rules through promtool; the image built and
//! run where a Docker engine answers.

use super::*;

async fn wait_ready(admin: SocketAddr, want: StatusCode, limit: Duration) -> Reply {
    let deadline = Instant::now() + limit;
    loop {
        let r = get(admin, "/ready").await;
        if r.status == want {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "/ready is still {} ({}) after {limit:?}",
            r.status,
            String::from_utf8_lossy(&r.body)
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_from_the_configmap_answers_the_probes_and_drains() {
    let docs = manifests();
    let shipped = config(&docs);
    let e = &shipped.engines[0];
    assert_eq!(e.flavor.as_str(), "vllm");
    let engine = common::engine(sim(SimFlavor::Vllm, e.dp_size, e.start_rank)).await;
    let cfg = config_for_test(&docs, &engine.url());
    let (delay, grace) = (cfg.server.shutdown_delay, cfg.server.drain_grace);
    let router = rankgate::app::Router::start(cfg).await.expect("router");
    assert!(router.grpc_addr.is_some(), "the gRPC front door is on");
    let (front, admin) = (router.addr, router.admin_addr);

    // Liveness: at once, whatever the fleet.
    let h = get(admin, "/health").await;
    assert_eq!(h.status, StatusCode::OK, "/health");

    // Readiness: once the engine's ranks are polled and routable.
    wait_ready(admin, StatusCode::OK, Duration::from_secs(10)).await;
    let rows = workers(&router).await;
    assert_eq!(rows.len(), e.dp_size as usize, "one worker per DP rank");
    assert!(
        rows.iter().all(|w| w["telemetry"] == "available"),
        "{rows:?}"
    );
    let r = chat(front, 4).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);

    // SIGTERM's sequence (main calls shutdown): /ready 503 at once, the front door still
    // serving during shutdown_delay, then exit well within the pod's grace period.
    let started = Instant::now();
    let shutdown = tokio::spawn(router.shutdown());
    let r = wait_ready(
        admin,
        StatusCode::SERVICE_UNAVAILABLE,
        Duration::from_secs(2),
    )
    .await;
    assert!(
        String::from_utf8_lossy(&r.body).contains("draining"),
        "{:?}",
        r.body
    );
    assert_eq!(get(admin, "/health").await.status, StatusCode::OK);
    assert!(started.elapsed() < delay, "still within shutdown_delay");
    let r = chat(front, 4).await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "accepted during shutdown_delay: {:?}",
        r.body
    );
    tokio::time::timeout(delay + grace, shutdown)
        .await
        .expect("the router stops within shutdown_delay + drain_grace")
        .expect("shutdown task");
    assert!(
        started.elapsed() >= delay,
        "accepting went on for shutdown_delay"
    );
}

/// `promtool check rules` on the rule file. promtool is Debian's `prometheus` package, which
/// `.ci/run` installs and with which it runs this test (`--ignored`).
#[test]
#[ignore = "needs promtool (Debian package prometheus): .ci/run installs it and runs this test"]
fn promtool_accepts_the_rule_file() {
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(root().join("deploy/prometheus/rules.yaml"))
        .output()
        .unwrap_or_else(|e| panic!("promtool: {e} (install the Debian package prometheus)"));
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("SUCCESS"), "{said}");
}

/// `promtool test rules` on the rule file's unit tests (`deploy/prometheus/rules_test.yaml`:
/// series in, alerts out), where promtool is installed as for the test above.
#[test]
#[ignore = "needs promtool (Debian package prometheus): .ci/run installs it and runs this test"]
fn promtool_rule_unit_tests_pass() {
    let out = Command::new("promtool")
        .args(["test", "rules"])
        .arg(root().join("deploy/prometheus/rules_test.yaml"))
        .output()
        .unwrap_or_else(|e| panic!("promtool: {e} (install the Debian package prometheus)"));
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("SUCCESS"), "{said}");
}

/// Builds the image and runs its binary on the ConfigMap's config. It needs a Docker engine
/// (and the base images from their registries, and minutes for the release build), so it is
/// ignored by a plain `cargo test` and reported so; `.ci/run` runs it (`--ignored`) where
/// `docker info` finds an engine. Run by hand without one, it fails saying so.
#[test]
#[ignore = "needs a Docker engine: .ci/run runs it where `docker info` answers"]
fn docker_image_builds_and_checks_the_config() {
    assert!(
        which("docker").is_some(),
        "no `docker` on PATH: deploy/Dockerfile cannot be built here"
    );
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let info_log = tmp.join("docker-info.log");
    let info = run_bounded(
        Command::new("docker").arg("info"),
        &info_log,
        Duration::from_secs(30),
    );
    assert!(
        info.is_some_and(|s| s.success()),
        "`docker info` found no Docker engine ({info:?}): deploy/Dockerfile cannot be built here\n{}",
        tail(&info_log)
    );

    let tag = "rankgate:deploy-test";
    let build_log = tmp.join("docker-build.log");
    let status = run_bounded(
        Command::new("docker")
            .args(["build", "-f", "deploy/Dockerfile", "-t", tag, "."])
            .current_dir(root()),
        &build_log,
        Duration::from_secs(40 * 60),
    );
    assert!(
        status.is_some_and(|s| s.success()),
        "docker build -f deploy/Dockerfile . : {status:?}\n{}",
        tail(&build_log)
    );

    // The image's binary, as its non-root user, accepts the ConfigMap's config where the
    // Deployment mounts it (`check` resolves the engine's name only to warn).
    let docs = manifests();
    let (file, text) = configmap_file(&docs);
    let dir = tmp.join("docker-config");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(&file), &text).unwrap();
    let run_log = tmp.join("docker-run.log");
    // The token's variable, as the Deployment fills it from the Secret.
    let var = token_var(&text).expect("the ConfigMap names the admin token's variable");
    let token_env = format!("{var}={TEST_ADMIN_TOKEN}");
    let status = run_bounded(
        Command::new("docker").args([
            "run",
            "--rm",
            "--network",
            "none",
            "-e",
            &token_env,
            "-v",
            &format!("{}:/etc/rankgate:ro", dir.display()),
            tag,
            "check",
            "--config",
            &format!("/etc/rankgate/{file}"),
        ]),
        &run_log,
        Duration::from_secs(120),
    );
    assert!(
        status.is_some_and(|s| s.success()),
        "rankgate check in the image: {status:?}\n{}",
        tail(&run_log)
    );
    assert!(
        std::fs::read_to_string(&run_log)
            .unwrap_or_default()
            .contains("flavor=vllm"),
        "{}",
        tail(&run_log)
    );
}
