//! What `kubectl apply -k deploy/kubernetes` needs besides the objects tests/deploy/ checks:
//! the image override that points the pods at a registry, the admin token's Secret (generated
//! from a file the operator writes, so nothing usable ships) wired to the variable the
//! ConfigMap's `server.admin_token_env` names, and the Prometheus Operator's objects as an
//! optional Component the base does not apply. A router started from the ConfigMap's config
//! with that variable filled answers `POST /reload` with the token; with kubectl at hand the
//! kustomization is rendered as `kubectl apply -k` would.
#![cfg(feature = "sim")] // the simulated engine

mod common;
mod manifests;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::admin::{admin, TempConfig};
use common::*;
use http::{Method, StatusCode};
use manifests::*;
use rankgate::config::Config;
use rankgate_sim::sim::SimFlavor;
use serde_json::{json, Value};

/// The secretGenerator entry of the base kustomization: (Secret name, key, file).
fn token_generator() -> (String, String, String) {
    let k = kustomization(KUBE);
    let gens = array_at(&k, "/secretGenerator");
    assert_eq!(gens.len(), 1, "one generated Secret: {gens:?}");
    let files = array_at(&gens[0], "/files");
    assert_eq!(files.len(), 1, "the token's one file: {files:?}");
    let (key, file) = (files[0].as_str().expect("key=file"))
        .split_once('=')
        .expect("a `key=file` source, so the key is not the file's name");
    (
        str_at(&gens[0], "/name").to_string(),
        key.to_string(),
        file.to_string(),
    )
}

#[test]
fn the_admin_token_comes_from_a_secret_the_operator_writes() {
    let docs = manifests();
    let (_, text) = configmap_file(&docs);
    let var = token_var(&text).expect("the ConfigMap sets server.admin_token_env");
    let (secret, key, file) = token_generator();

    // The Deployment fills that variable from that Secret's key.
    let env = array_at(container(one(&docs, "Deployment")), "/env");
    let from = env
        .iter()
        .find(|e| e["name"] == var.as_str())
        .unwrap_or_else(|| panic!("the Deployment sets no {var}: {env:?}"));
    assert_eq!(str_at(from, "/valueFrom/secretKeyRef/name"), secret);
    assert_eq!(str_at(from, "/valueFrom/secretKeyRef/key"), key);
    assert!(from.get("value").is_none(), "no token in the Deployment");

    // No token ships: no Secret object among the files, and the generator's file is one git
    // ignores, which the operator writes.
    assert!(docs.iter().all(|d| d["kind"] != "Secret"), "a Secret ships");
    let ignored = read(&format!("{KUBE}/.gitignore"));
    assert!(
        ignored.lines().any(|l| l.trim() == file),
        "{KUBE}/.gitignore lists {file}"
    );
    let guide = read("docs/deploy.md");
    for needle in [
        format!("{KUBE}/{file}"),
        "kubectl create secret generic".into(),
    ] {
        assert!(guide.contains(&needle), "docs/deploy.md says {needle:?}");
    }
}

#[test]
fn the_image_override_points_the_deployment_at_a_registry() {
    let docs = manifests();
    let image = str_at(container(one(&docs, "Deployment")), "/image");
    let (name, tag) = image.rsplit_once(':').expect("the image has a tag");
    assert_eq!(tag, env!("CARGO_PKG_VERSION"), "the image is this version");
    let k = kustomization(KUBE);
    let images = array_at(&k, "/images");
    assert_eq!(images.len(), 1, "{images:?}");
    // kustomize matches `name` against the image without its tag: anything else overrides
    // nothing, silently.
    assert_eq!(str_at(&images[0], "/name"), name);
    let new_name = str_at(&images[0], "/newName");
    assert!(
        new_name.contains('/') && new_name.ends_with(&format!("/{name}")),
        "newName is a registry path to the image: {new_name}"
    );
    assert_eq!(str_at(&images[0], "/newTag"), tag);
    let guide = read("docs/deploy.md");
    for needle in ["docker push", "newName", "newTag", "ErrImagePull"] {
        assert!(guide.contains(needle), "docs/deploy.md says {needle:?}");
    }
}

#[test]
fn monitoring_objects_are_an_optional_component() {
    let base = kustomization(KUBE);
    assert!(
        base.get("components").is_none(),
        "the base applies no Component: its objects need CRDs not every cluster has"
    );
    let component = kustomization(MONITORING);
    assert_eq!(
        str_at(&component, "/apiVersion"),
        "kustomize.config.k8s.io/v1alpha1"
    );
    assert_eq!(str_at(&component, "/kind"), "Component");
    let listed: BTreeSet<String> = array_at(&component, "/resources")
        .iter()
        .map(|r| r.as_str().unwrap().to_string())
        .collect();
    let on_disk: BTreeSet<String> = std::fs::read_dir(root().join(MONITORING))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    assert_eq!(listed, on_disk, "the Component's resources vs its files");
    let objects = resources_of(MONITORING);
    let kinds: BTreeSet<&str> = (objects.iter())
        .map(|d| d["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, MONITORING_KINDS.into_iter().collect());
    for o in &objects {
        assert_eq!(str_at(o, "/apiVersion"), "monitoring.coreos.com/v1");
    }

    // The ServiceMonitor scrapes /metrics through the admin Service's port, and selects that
    // Service only (the front door's has no admin port).
    let docs = manifests();
    let svc = service(&docs, "rankgate-admin");
    let front = service(&docs, "rankgate");
    let sm = one(&objects, "ServiceMonitor");
    let sm_sel = sm["spec"]["selector"]["matchLabels"].as_object().unwrap();
    assert!(
        sm_sel
            .iter()
            .all(|(k, v)| &svc["metadata"]["labels"][k] == v),
        "the ServiceMonitor selects the admin Service"
    );
    assert!(
        !sm_sel
            .iter()
            .all(|(k, v)| &front["metadata"]["labels"][k] == v),
        "the ServiceMonitor does not select the front door's Service"
    );
    let eps = array_at(sm, "/spec/endpoints");
    assert_eq!(eps.len(), 1);
    assert_eq!(eps[0]["path"], "/metrics");
    let svc_port = array_at(svc, "/spec/ports")
        .iter()
        .find(|p| p["name"] == eps[0]["port"])
        .expect("the ServiceMonitor's port is a Service port");
    assert_eq!(
        resolve_port(container(one(&docs, "Deployment")), &svc_port["targetPort"]),
        config(&docs).server.admin_listen.port(),
        "metrics are scraped from the admin listener"
    );

    // How to add it, where to.
    assert!(read(&format!("{KUBE}/kustomization.yaml")).contains("#   - components/monitoring"));
    let guide = read("docs/deploy.md");
    for needle in ["components/monitoring", "CRDs"] {
        assert!(guide.contains(needle), "docs/deploy.md says {needle:?}");
    }
}

/// The alerts ship twice, as a rule file and as a PrometheusRule: the same groups, and every
/// alert has a summary and reads only series rankgate exports (or the process collector's).
#[test]
fn the_prometheus_rule_carries_the_rule_files_alerts() {
    let file = yaml_docs("deploy/prometheus/rules.yaml");
    let crd = yaml_docs(&format!("{MONITORING}/prometheusrule.yaml"));
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

/// The ConfigMap's config as a file a router on loopback reads (and reads again on reload),
/// pointed at `engine_url`.
fn loopback_text(docs: &[Value], engine_url: &str) -> String {
    let mut text = config_text_for_test(docs, engine_url);
    let cfg = config(docs);
    let grpc = cfg.server.grpc_listen.expect("grpc_listen");
    for addr in [cfg.server.listen, cfg.server.admin_listen, grpc] {
        let quoted = format!("\"{addr}\"");
        assert_eq!(text.matches(&quoted).count(), 1, "{quoted} once");
        text = text.replace(&quoted, "\"127.0.0.1:0\"");
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_reload_works_with_the_shipped_token_setup() {
    let docs = manifests();
    let e = &config(&docs).engines[0];
    let (dp, start) = (e.dp_size, e.start_rank);
    let a = engine(sim(SimFlavor::Vllm, dp, start)).await;
    let b = engine(sim(SimFlavor::Vllm, dp, start)).await;
    let file = TempConfig::new(&loopback_text(&docs, &a.url()));
    // The pod's environment: the Secret's token in the variable the config names.
    fill_token_var(&read_file(&file.0));
    let cfg = Config::load(&file.0).expect("the ConfigMap's config on loopback");
    let r = rankgate::app::Router::start_from(cfg, Some(file.0.clone()))
        .await
        .expect("router");
    wait_state(&r, &[0], "available").await;

    let refused = admin(&r, Method::POST, "/reload", None, None).await;
    assert_eq!(
        refused.status,
        StatusCode::UNAUTHORIZED,
        "{:?}",
        refused.body
    );
    let wrong = admin(&r, Method::POST, "/reload", Some("not-it"), None).await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED, "{:?}", wrong.body);

    // The ConfigMap edited to another engine, then reloaded as docs/deploy.md says.
    file.write(&loopback_text(&docs, &b.url()));
    let reply = admin(&r, Method::POST, "/reload", Some(TEST_ADMIN_TOKEN), None).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let v = reply.json();
    assert_eq!(v["added"], json!([b.url()]), "{v}");
    assert_eq!(v["removed"], json!([a.url()]), "{v}");
    assert_eq!(v["restart_needed"], json!([]), "{v}");
    let rows = wait_workers(&r, Duration::from_secs(10), |rows| {
        !rows.is_empty()
            && (rows.iter()).all(|w| {
                w["id"].as_str().is_some_and(|id| id.starts_with(&b.url()))
                    && w["telemetry"] == "available"
            })
    })
    .await;
    assert_eq!(rows.len(), dp as usize);
}

fn read_file(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// Copies a directory tree (the kustomization and its Component).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dest = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &dest);
        } else {
            std::fs::copy(entry.path(), dest).unwrap();
        }
    }
}

/// `kubectl kustomize` on `dir`: its exit and output (stdout and stderr).
fn kustomize(dir: &Path, log: &Path) -> (bool, String) {
    let status = run_bounded(
        Command::new("kubectl").arg("kustomize").arg(dir),
        log,
        Duration::from_secs(60),
    );
    (status.is_some_and(|s| s.success()), read_file(log))
}

/// `kubectl kustomize` as `kubectl apply -k` renders: refused without the token's file; with
/// it, the base's objects with the generated Secret (its hashed name written into the
/// Deployment) and the registry's image; with the Component, the monitoring objects too, in
/// the same namespace.
#[test]
#[ignore = "needs kubectl (for its built-in kustomize): run with --ignored kustomize"]
fn kubectl_kustomize_renders_the_base_and_the_component() {
    assert!(which("kubectl").is_some(), "no `kubectl` on PATH");
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR")).join("deploy-kustomize");
    let _ = std::fs::remove_dir_all(&tmp);
    let base = tmp.join("base");
    copy_dir(&root().join(KUBE), &base);
    let (_, _, file) = token_generator();
    let _ = std::fs::remove_file(base.join(&file));

    let (ok, out) = kustomize(&base, &tmp.join("missing.log"));
    assert!(!ok && out.contains(&file), "refused, naming {file}: {out}");

    std::fs::write(base.join(&file), format!("{TEST_ADMIN_TOKEN}\n")).unwrap();
    let (ok, out) = kustomize(&base, &tmp.join("base.log"));
    assert!(ok, "{out}");
    let docs = yaml_text_docs("kubectl kustomize", &out);
    let kinds: BTreeSet<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    let want: BTreeSet<&str> = KINDS.into_iter().chain(["Secret"]).collect();
    assert_eq!(kinds, want);
    let secret = one(&docs, "Secret");
    let c = container(one(&docs, "Deployment"));
    let env = array_at(c, "/env");
    assert!(
        (env.iter()).any(|e| e["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]),
        "the Deployment reads the generated Secret: {env:?}"
    );
    let k = kustomization(KUBE);
    let image = format!(
        "{}:{}",
        str_at(&k, "/images/0/newName"),
        str_at(&k, "/images/0/newTag")
    );
    assert_eq!(str_at(c, "/image"), image);

    let overlay = tmp.join("with-monitoring");
    std::fs::create_dir_all(&overlay).unwrap();
    let namespace = str_at(&k, "/namespace");
    std::fs::write(
        overlay.join("kustomization.yaml"),
        format!("namespace: {namespace}\nresources:\n  - ../base\ncomponents:\n  - ../base/components/monitoring\n"),
    )
    .unwrap();
    let (ok, out) = kustomize(&overlay, &tmp.join("overlay.log"));
    assert!(ok, "{out}");
    let docs = yaml_text_docs("kubectl kustomize", &out);
    for kind in MONITORING_KINDS {
        assert_eq!(str_at(one(&docs, kind), "/metadata/namespace"), namespace);
    }
    // One object of each kind, but for the two Services (the front door and the admin port).
    assert_eq!(
        docs.len(),
        want.len() + 1 + MONITORING_KINDS.len(),
        "one object of each kind, two Services"
    );
    for name in ["rankgate", "rankgate-admin"] {
        service(&docs, name);
    }
}
