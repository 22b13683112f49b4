//! The deployment material checked against the real thing: the Kubernetes manifests under
//! `deploy/kubernetes/` (read through their `kustomization.yaml`) and `deploy/Dockerfile`.
//!
//! The ConfigMap's `rankgate.toml` must be a config the binary accepts, its ports must be the
//! ones the Deployment and the Service name, the probes must hit the admin listener's `/health`
//! and `/ready`, the grace period must cover the drain, the image's default command must read the
//! file where the Deployment mounts it, and everything runs as non-root. A real router started
//! from that very config (listeners moved to 127.0.0.1:0, the engine URL pointed at a simulated
//! vLLM engine with the same ranks) must answer the probes as the manifests expect, and drain as
//! the comments say. With a Docker engine at hand, the image is built and its binary run.
#![cfg(feature = "sim")] // the simulated engine

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use http::StatusCode;
use rankgate::config::Config;
use rankgate_sim::sim::SimFlavor;
use serde::Deserialize;
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    let p = root().join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// Every YAML document of a file, as JSON values (empty documents left out).
fn yaml_docs(rel: &str) -> Vec<Value> {
    let text = read(rel);
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{rel}: {e}")))
        .filter(|v| !v.is_null())
        .collect()
}

const KUBE: &str = "deploy/kubernetes";

/// What `kubectl apply -k deploy/kubernetes` creates (the Helm chart creates these too).
const KINDS: [&str; 8] = [
    "ConfigMap",
    "Deployment",
    "Role",
    "RoleBinding",
    "Service",
    "ServiceAccount",
    "ServiceMonitor",
    "PrometheusRule",
];

/// The resources `kustomization.yaml` lists, parsed, in its order.
fn manifests() -> Vec<Value> {
    let kust = yaml_docs(&format!("{KUBE}/kustomization.yaml"));
    assert_eq!(kust.len(), 1, "kustomization.yaml holds one document");
    let resources = kust[0]["resources"]
        .as_array()
        .expect("kustomization.yaml lists resources");
    resources
        .iter()
        .flat_map(|r| yaml_docs(&format!("{KUBE}/{}", r.as_str().expect("resource path"))))
        .collect()
}

/// The one resource of this kind (panics on none or several).
fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = docs.iter().filter(|d| d["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "expected one {kind}, found {}", found.len());
    found[0]
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {pointer} in {v}"))
}

fn array_at<'a>(v: &'a Value, pointer: &str) -> &'a Vec<Value> {
    v.pointer(pointer)
        .and_then(Value::as_array)
        .unwrap_or_else(|| panic!("no array at {pointer} in {v}"))
}

/// The Deployment's one container.
fn container(deploy: &Value) -> &Value {
    let cs = array_at(deploy, "/spec/template/spec/containers");
    assert_eq!(cs.len(), 1, "one container in the rankgate pod");
    &cs[0]
}

/// A port given by number or by the name of one of the container's ports, as a number.
fn resolve_port(container: &Value, port: &Value) -> u16 {
    if let Some(n) = port.as_u64() {
        return u16::try_from(n).expect("port fits u16");
    }
    let name = port.as_str().unwrap_or_else(|| panic!("port {port}"));
    let p = array_at(container, "/ports")
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no container port named {name:?}"));
    u16::try_from(p["containerPort"].as_u64().expect("containerPort")).expect("port fits u16")
}

/// The ConfigMap's file name and text (it holds exactly one file).
fn configmap_file(docs: &[Value]) -> (String, String) {
    let data = one(docs, "ConfigMap")["data"]
        .as_object()
        .expect("ConfigMap data");
    assert_eq!(data.len(), 1, "the ConfigMap holds one file");
    let (name, text) = data.iter().next().unwrap();
    (name.clone(), text.as_str().expect("file text").to_string())
}

fn config(docs: &[Value]) -> Config {
    let (name, text) = configmap_file(docs);
    assert_eq!(name, "rankgate.toml");
    Config::from_str(&text).unwrap_or_else(|e| panic!("the ConfigMap's {name}: {e}\n{text}"))
}

/// The three listeners' ports: front door, admin, gRPC.
fn config_ports(cfg: &Config) -> [u16; 3] {
    let grpc = cfg
        .server
        .grpc_listen
        .expect("the ConfigMap enables the gRPC front door");
    [
        cfg.server.listen.port(),
        cfg.server.admin_listen.port(),
        grpc.port(),
    ]
}

#[test]
fn kustomization_lists_every_manifest_and_names_agree() {
    // Every manifest in the folder is applied by `kubectl apply -k`.
    let listed: BTreeSet<String> = yaml_docs(&format!("{KUBE}/kustomization.yaml"))[0]["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect();
    let on_disk: BTreeSet<String> = std::fs::read_dir(root().join(KUBE))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    assert_eq!(listed, on_disk, "kustomization.yaml resources vs files");

    let docs = manifests();
    let kinds: BTreeSet<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, KINDS.into_iter().collect(), "resource kinds");
    for d in &docs {
        assert_eq!(
            d.pointer("/metadata/labels/app.kubernetes.io~1name"),
            Some(&Value::from("rankgate")),
            "{} {} carries app.kubernetes.io/name: rankgate",
            d["kind"],
            d["metadata"]["name"]
        );
    }

    let deploy = one(&docs, "Deployment");
    let pod_labels = &deploy["spec"]["template"]["metadata"]["labels"];
    let selects = |sel: &Value| {
        sel.as_object()
            .unwrap()
            .iter()
            .all(|(k, v)| &pod_labels[k] == v)
    };
    assert!(selects(&deploy["spec"]["selector"]["matchLabels"]));
    let svc = one(&docs, "Service");
    assert!(
        selects(&svc["spec"]["selector"]),
        "the Service selects the pods"
    );
    assert_eq!(deploy["spec"]["replicas"], 2);

    // The ConfigMap the pod mounts is the one applied.
    let cm_name = one(&docs, "ConfigMap")["metadata"]["name"].clone();
    let volumes = array_at(deploy, "/spec/template/spec/volumes");
    assert!(
        volumes.iter().any(|v| v["configMap"]["name"] == cm_name),
        "a volume of ConfigMap {cm_name}"
    );

    // The pods run as the ServiceAccount, which the RoleBinding binds to the Role, which may
    // read pods and nothing else.
    let sa = str_at(one(&docs, "ServiceAccount"), "/metadata/name");
    assert_eq!(str_at(deploy, "/spec/template/spec/serviceAccountName"), sa);
    let role = one(&docs, "Role");
    let binding = one(&docs, "RoleBinding");
    assert_eq!(str_at(binding, "/roleRef/kind"), "Role");
    assert_eq!(
        str_at(binding, "/roleRef/name"),
        str_at(role, "/metadata/name")
    );
    let subjects = array_at(binding, "/subjects");
    assert!(subjects
        .iter()
        .any(|s| s["kind"] == "ServiceAccount" && s["name"] == sa));
    let rules = array_at(role, "/rules");
    assert_eq!(rules.len(), 1, "one rule: {rules:?}");
    assert_eq!(rules[0]["apiGroups"], serde_json::json!([""]));
    assert_eq!(rules[0]["resources"], serde_json::json!(["pods"]));
    let verbs: BTreeSet<&str> = array_at(&rules[0], "/verbs")
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(verbs, ["get", "list", "watch"].into_iter().collect());

    // The ServiceMonitor scrapes /metrics through the Service's admin port.
    let sm = one(&docs, "ServiceMonitor");
    assert_eq!(str_at(sm, "/apiVersion"), "monitoring.coreos.com/v1");
    let sm_sel = &sm["spec"]["selector"]["matchLabels"];
    assert!(
        sm_sel
            .as_object()
            .unwrap()
            .iter()
            .all(|(k, v)| &svc["metadata"]["labels"][k] == v),
        "the ServiceMonitor selects the Service"
    );
    let eps = array_at(sm, "/spec/endpoints");
    assert_eq!(eps.len(), 1);
    assert_eq!(eps[0]["path"], "/metrics");
    let svc_port = array_at(svc, "/spec/ports")
        .iter()
        .find(|p| p["name"] == eps[0]["port"])
        .expect("the ServiceMonitor's port is a Service port");
    let cfg = config(&docs);
    assert_eq!(
        resolve_port(container(deploy), &svc_port["targetPort"]),
        cfg.server.admin_listen.port(),
        "metrics are scraped from the admin listener"
    );
}

#[test]
fn config_ports_are_the_deployment_and_service_ports() {
    let docs = manifests();
    let cfg = config(&docs);
    let [http, admin, grpc] = config_ports(&cfg);
    for (what, addr) in [
        ("listen", cfg.server.listen),
        ("admin_listen", cfg.server.admin_listen),
        ("grpc_listen", cfg.server.grpc_listen.unwrap()),
    ] {
        assert!(
            addr.ip().is_unspecified(),
            "server.{what} = {addr}: a pod must listen on all interfaces to be reachable"
        );
    }
    assert_eq!([http, admin, grpc], [8080, 9090, 50050]);
    assert_eq!(cfg.server.shutdown_delay, Duration::from_secs(5));
    assert_eq!(cfg.server.drain_grace, Duration::from_secs(30));
    assert!(!cfg.engines.is_empty());

    let deploy = one(&docs, "Deployment");
    let c = container(deploy);
    let by_name = |name: &str| resolve_port(c, &Value::from(name));
    assert_eq!(
        [by_name("http"), by_name("admin"), by_name("grpc")],
        [http, admin, grpc]
    );
    let container_ports: BTreeSet<u16> = array_at(c, "/ports")
        .iter()
        .map(|p| resolve_port(c, &p["containerPort"]))
        .collect();
    assert_eq!(container_ports, [http, admin, grpc].into_iter().collect());

    let svc = one(&docs, "Service");
    let ports = array_at(svc, "/spec/ports");
    assert_eq!(ports.len(), 3);
    let target = |name: &str| {
        let p = ports
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("Service port {name}"));
        resolve_port(c, &p["targetPort"])
    };
    assert_eq!(
        [target("http"), target("admin"), target("grpc")],
        [http, admin, grpc]
    );
    let grpc_port = ports.iter().find(|p| p["name"] == "grpc").unwrap();
    assert_eq!(grpc_port["appProtocol"], "kubernetes.io/h2c");
}

#[test]
fn probes_hit_the_admin_listener() {
    let docs = manifests();
    let cfg = config(&docs);
    let c = container(one(&docs, "Deployment"));
    for (probe, path) in [("livenessProbe", "/health"), ("readinessProbe", "/ready")] {
        let get = &c[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe}");
        assert_eq!(
            resolve_port(c, &get["port"]),
            cfg.server.admin_listen.port(),
            "{probe} on the admin port"
        );
        assert!(
            get.get("scheme").is_none() || get["scheme"] == "HTTP",
            "{probe}: the admin listener is plain HTTP"
        );
    }
}

#[test]
fn grace_period_covers_shutdown_delay_and_drain() {
    let docs = manifests();
    let cfg = config(&docs);
    let grace = one(&docs, "Deployment")
        .pointer("/spec/template/spec/terminationGracePeriodSeconds")
        .and_then(Value::as_u64)
        .expect("terminationGracePeriodSeconds");
    let drain = cfg.server.shutdown_delay + cfg.server.drain_grace;
    assert!(
        Duration::from_secs(grace) > drain,
        "terminationGracePeriodSeconds {grace} must exceed shutdown_delay + drain_grace = {drain:?}"
    );
}

/// The Dockerfile's instructions (continuations joined, comments dropped), as (INSTRUCTION,
/// arguments), and where its final stage starts.
fn dockerfile() -> (Vec<(String, String)>, usize) {
    let text = read("deploy/Dockerfile");
    let mut instrs = Vec::new();
    let mut cur = String::new();
    for raw in text.lines() {
        let l = raw.trim();
        if l.starts_with('#') || l.is_empty() {
            continue;
        }
        if let Some(head) = l.strip_suffix('\\') {
            cur.push_str(head);
            cur.push(' ');
            continue;
        }
        cur.push_str(l);
        let line = std::mem::take(&mut cur);
        let (i, rest) = line.split_once(' ').unwrap_or((&line, ""));
        instrs.push((i.to_ascii_uppercase(), rest.trim().to_string()));
    }
    let last_from = instrs
        .iter()
        .rposition(|(i, _)| i == "FROM")
        .expect("a FROM");
    (instrs, last_from)
}

fn exec_form(args: &str) -> Vec<String> {
    serde_json::from_str(args).unwrap_or_else(|e| panic!("{args:?} is not exec form: {e}"))
}

#[test]
fn image_reads_the_mounted_config_as_non_root() {
    let docs = manifests();
    let (all, last_from) = dockerfile();
    let stage = &all[last_from..];
    let get = |name: &str| -> Vec<&str> {
        stage
            .iter()
            .filter(|(i, _)| i == name)
            .map(|(_, a)| a.as_str())
            .collect()
    };
    assert_eq!(get("ENTRYPOINT").len(), 1);
    assert_eq!(exec_form(get("ENTRYPOINT")[0]), ["rankgate"]);
    assert!(
        get("COPY")
            .iter()
            .any(|c| c.ends_with(" /usr/local/bin/rankgate")),
        "the binary lands at /usr/local/bin/rankgate: {stage:?}"
    );
    let cmd = exec_form(get("CMD").last().expect("a CMD"));
    assert_eq!(cmd[0], "serve");
    let at = cmd.iter().position(|a| a == "--config").expect("--config");
    let config_path = Path::new(&cmd[at + 1]);

    // Where the Deployment mounts the ConfigMap, plus the ConfigMap's file name.
    let deploy = one(&docs, "Deployment");
    let c = container(deploy);
    let cm_name = &one(&docs, "ConfigMap")["metadata"]["name"];
    let volume = array_at(deploy, "/spec/template/spec/volumes")
        .iter()
        .find(|v| &v["configMap"]["name"] == cm_name)
        .expect("the ConfigMap's volume");
    let mount = array_at(c, "/volumeMounts")
        .iter()
        .find(|m| m["name"] == volume["name"])
        .expect("the ConfigMap's volume is mounted");
    let (file, _) = configmap_file(&docs);
    assert_eq!(
        config_path,
        Path::new(str_at(mount, "/mountPath")).join(file),
        "the image's CMD reads the file the Deployment mounts"
    );
    // The Deployment spells the command out too: the same one.
    if let Some(args) = c.get("args") {
        let args: Vec<String> = serde_json::from_value(args.clone()).unwrap();
        assert_eq!(args, cmd, "the Deployment's args are the image's CMD");
    }
    assert!(c.get("command").is_none(), "the image's ENTRYPOINT is kept");

    // The image exposes exactly the config's ports.
    let cfg = config(&docs);
    let exposed: BTreeSet<u16> = get("EXPOSE")
        .iter()
        .flat_map(|e| e.split_whitespace())
        .map(|p| p.trim_end_matches("/tcp").parse().expect("EXPOSE port"))
        .collect();
    assert_eq!(exposed, config_ports(&cfg).into_iter().collect());

    // Non-root: the image's USER, the pod's and the container's security contexts.
    let user = get("USER");
    let user = user.last().expect("a USER in the final stage");
    let uid = user.split(':').next().unwrap();
    assert!(
        uid != "0" && uid != "root",
        "the image runs as non-root: USER {user}"
    );
    let pod_sc = &deploy["spec"]["template"]["spec"]["securityContext"];
    assert_eq!(pod_sc["runAsNonRoot"], true);
    if let Some(u) = pod_sc["runAsUser"].as_u64() {
        assert_ne!(u, 0);
        assert_eq!(
            uid.parse::<u64>().ok(),
            Some(u),
            "the pod's runAsUser is the image's USER"
        );
    }
    let sc = &c["securityContext"];
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert_ne!(sc["runAsUser"], 0);
    assert_ne!(sc["runAsNonRoot"], false);

    // The builder compiles the production router (no simulator) from the lock file.
    let build = all[..last_from]
        .iter()
        .find(|(i, a)| i == "RUN" && a.contains("cargo build"))
        .map(|(_, a)| a.as_str())
        .expect("a RUN cargo build in the builder");
    for flag in [
        "--release",
        "--locked",
        "--no-default-features",
        "--bin rankgate",
    ] {
        assert!(build.contains(flag), "cargo build {flag}: {build}");
    }
    assert!(get("RUN").is_empty(), "nothing runs in the runtime stage");
}

/// The ConfigMap's config, moved onto 127.0.0.1:0 and pointed at `engine_url` instead of the
/// engine it names, which must be a single vLLM engine.
fn config_for_test(docs: &[Value], engine_url: &str) -> Config {
    let (_, text) = configmap_file(docs);
    let raw: toml::Table = toml::from_str(&text).expect("TOML");
    let engines = raw["engines"].as_array().expect("[[engines]]");
    assert_eq!(engines.len(), 1, "the example fleet is one engine");
    let url = engines[0]["url"].as_str().expect("engines[0].url");
    let quoted = format!("\"{url}\"");
    assert_eq!(
        text.matches(&quoted).count(),
        1,
        "{quoted} once in the text"
    );
    let mut cfg = Config::from_str(&text.replace(&quoted, &format!("\"{engine_url}\"")))
        .expect("the rewritten config");
    let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
    cfg.server.listen = loopback;
    cfg.server.admin_listen = loopback;
    cfg.server.grpc_listen = cfg.server.grpc_listen.map(|_| loopback);
    cfg
}

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

/// Runs a command with its output sent to `log`, killing it after `limit`. `None` on timeout.
fn run_bounded(cmd: &mut Command, log: &Path, limit: Duration) -> Option<std::process::ExitStatus> {
    let out = std::fs::File::create(log).expect("log file");
    let err = out.try_clone().unwrap();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("spawn");
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Builds the image and runs its binary on the ConfigMap's config. It needs a Docker engine
/// The alerts ship twice, as a rule file and as a PrometheusRule: the same groups, and every
/// alert has a summary and reads only series rankgate exports (or the process collector's).
#[test]
fn the_prometheus_rule_carries_the_rule_files_alerts() {
    let file = yaml_docs("deploy/prometheus/rules.yaml");
    let crd = yaml_docs(&format!("{KUBE}/prometheusrule.yaml"));
    assert_eq!(
        crd[0]["spec"], file[0],
        "prometheusrule.yaml spec vs rules.yaml"
    );
    let rules = array_at(&file[0], "/groups/0/rules");
    assert!(rules.len() >= 5, "{rules:?}");
    let exported = read("docs/metrics.md");
    for r in rules {
        let name = str_at(r, "/alert");
        assert!(
            r.pointer("/annotations/summary").is_some(),
            "{name} has no summary"
        );
        let expr = str_at(r, "/expr");
        for metric in expr
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("rankgate_"))
        {
            let family = ["_bucket", "_count", "_sum"]
                .iter()
                .fold(metric, |m, s| m.strip_suffix(s).unwrap_or(m));
            assert!(
                exported.contains(family),
                "{name}: {family} is not in docs/metrics.md"
            );
        }
    }
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

/// (and the base images from their registries, and minutes for the release build), so it is
/// ignored by a plain `cargo test` and reported so; `.ci/run` runs it (`--ignored`) where
/// `docker info` finds an engine. Run by hand without one, it fails saying so.
#[test]
#[ignore = "needs a Docker engine: .ci/run runs it where `docker info` answers"]
fn docker_image_builds_and_checks_the_config() {
    assert!(
        which_docker().is_some(),
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
    std::fs::write(dir.join(&file), text).unwrap();
    let run_log = tmp.join("docker-run.log");
    let status = run_bounded(
        Command::new("docker").args([
            "run",
            "--rm",
            "--network",
            "none",
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

fn which_docker() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("docker"))
        .find(|p| p.is_file())
}

const CHART: &str = "deploy/helm/rankgate";

/// The Helm chart, read without Helm: its default config is one rankgate accepts, on the ports
/// the chart's Service and probes use; every value a template reads is in values.yaml; the
/// alerts it ships are the rule file's; its appVersion is this crate's.
#[test]
fn the_helm_charts_defaults_hold_together() {
    let chart = &yaml_docs(&format!("{CHART}/Chart.yaml"))[0];
    assert_eq!(str_at(chart, "/apiVersion"), "v2");
    assert_eq!(str_at(chart, "/appVersion"), env!("CARGO_PKG_VERSION"));
    let values = &yaml_docs(&format!("{CHART}/values.yaml"))[0];
    let cfg = Config::from_str(str_at(values, "/config"))
        .unwrap_or_else(|e| panic!("values.yaml config: {e}"));
    let [http, admin, grpc] = config_ports(&cfg);
    for (name, port) in [("http", http), ("admin", admin), ("grpc", grpc)] {
        assert_eq!(
            values
                .pointer(&format!("/ports/{name}"))
                .and_then(Value::as_u64),
            Some(u64::from(port)),
            "values.yaml ports.{name} vs the config's listen address"
        );
    }
    assert_eq!(
        read(&format!("{CHART}/files/rules.yaml")),
        read("deploy/prometheus/rules.yaml"),
        "the chart's alerts are deploy/prometheus/rules.yaml"
    );
    // `.Values.a.b` in every template names a key values.yaml has.
    let mut read_values = BTreeSet::new();
    for entry in std::fs::read_dir(root().join(CHART).join("templates")).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for (i, _) in text.match_indices(".Values.") {
            let path: String = text[i + ".Values.".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '.')
                .collect();
            read_values.insert(path.trim_end_matches('.').to_string());
        }
    }
    assert!(read_values.len() > 20, "{read_values:?}");
    for path in &read_values {
        let pointer = format!("/{}", path.replace('.', "/"));
        assert!(
            values.pointer(&pointer).is_some(),
            "templates read .Values.{path}, which values.yaml lacks"
        );
    }
}

/// `helm lint` and `helm template` with every optional object on; the rendered manifests hold
/// what the kustomize ones hold, plus the PodDisruptionBudget and the token Secret.
#[test]
#[ignore = "needs helm: .ci/run runs it where `helm` is on PATH"]
fn helm_renders_the_chart() {
    let chart = root().join(CHART);
    let lint = Command::new("helm")
        .arg("lint")
        .arg(&chart)
        .output()
        .expect("helm on PATH");
    assert!(
        lint.status.success(),
        "{}",
        String::from_utf8_lossy(&lint.stdout)
    );
    let out = Command::new("helm")
        .args(["template", "rg"])
        .arg(&chart)
        .args([
            "--set",
            "serviceMonitor.enabled=true",
            "--set",
            "prometheusRule.enabled=true",
            "--set",
            "adminToken.value=secret-token",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let docs: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect();
    let kinds: BTreeSet<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    for k in KINDS.into_iter().chain(["PodDisruptionBudget", "Secret"]) {
        assert!(kinds.contains(k), "no {k} in {kinds:?}");
    }
    let cfg_map = one(&docs, "ConfigMap");
    Config::from_str(str_at(cfg_map, "/data/rankgate.toml")).unwrap();
    let env = array_at(container(one(&docs, "Deployment")), "/env");
    assert!(
        env.iter().any(|e| e["name"] == "RANKGATE_ADMIN_TOKEN"),
        "{env:?}"
    );
}
