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
//! The monitoring Component, the image override and the admin token's Secret are checked in
//! tests/deploy_kustomize.rs; both read the files through tests/manifests.
#![cfg(feature = "sim")] // the simulated engine

#[path = "../common/mod.rs"]
mod common;
mod helm;
#[path = "../manifests/mod.rs"]
mod manifests;
mod running;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use http::StatusCode;
use manifests::*;
use rankgate::config::Config;
use rankgate_sim::sim::SimFlavor;
use serde_json::Value;

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
    let services: Vec<&Value> = docs.iter().filter(|d| d["kind"] == "Service").collect();
    assert_eq!(
        services.len(),
        2,
        "the front door's Service and the admin one"
    );
    for svc in services {
        assert!(
            selects(&svc["spec"]["selector"]),
            "Service {} selects the pods",
            svc["metadata"]["name"]
        );
    }
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

    // The front door's Service carries HTTP and gRPC only; the admin port has its own
    // ClusterIP Service, so a LoadBalancer front door never publishes it.
    let front = service(&docs, "rankgate");
    let admin_svc = service(&docs, "rankgate-admin");
    assert_eq!(array_at(front, "/spec/ports").len(), 2);
    assert_eq!(array_at(admin_svc, "/spec/ports").len(), 1);
    assert_eq!(str_at(admin_svc, "/spec/type"), "ClusterIP");
    let ports: Vec<&Value> = (array_at(front, "/spec/ports").iter())
        .chain(array_at(admin_svc, "/spec/ports"))
        .collect();
    let target = |name: &str| {
        let p = ports
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("Service port {name}"));
        resolve_port(c, &p["targetPort"])
    };
    assert!(
        !array_at(front, "/spec/ports")
            .iter()
            .any(|p| p["name"] == "admin"),
        "the front door's Service has no admin port"
    );
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
