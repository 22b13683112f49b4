//! The Helm chart: its defaults hold together, and it renders where helm is installed.

use super::*;

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
    // `service.type` is the front door's alone: the admin port is on a second Service,
    // always ClusterIP, so a LoadBalancer front door never publishes it.
    let services = read(&format!("{CHART}/templates/service.yaml"));
    let [front, admin_svc] = services.split("\n---\n").collect::<Vec<_>>()[..] else {
        panic!("templates/service.yaml: the front door's Service, ---, the admin one");
    };
    assert!(
        front.contains("type: {{ .Values.service.type }}"),
        "{front}"
    );
    assert!(!front.contains("name: admin"), "{front}");
    assert!(admin_svc.contains("type: ClusterIP"), "{admin_svc}");
    assert!(admin_svc.contains("name: admin"), "{admin_svc}");
    assert!(!admin_svc.contains(".Values.service.type"), "{admin_svc}");
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
    let template = |extra: &[&str]| {
        Command::new("helm")
            .args(["template", "rg"])
            .arg(&chart)
            .args(["--set", "adminToken.value=secret-token"])
            .args(extra)
            .output()
            .unwrap()
    };
    // A token without the config's admin_token_env would never be read: refused.
    let out = template(&[]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && said.contains("admin_token_env"),
        "{said}"
    );
    // The default config with its admin_token_env line on.
    let values = &yaml_docs(&format!("{CHART}/values.yaml"))[0];
    let on = str_at(values, "/config").replace("# admin_token_env", "admin_token_env");
    let file = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("helm-config.toml");
    std::fs::write(&file, &on).unwrap();
    let set_file = format!("config={}", file.display());
    let out = template(&[
        "--set",
        "serviceMonitor.enabled=true",
        "--set",
        "prometheusRule.enabled=true",
        "--set",
        "service.type=LoadBalancer",
        "--set-file",
        &set_file,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let docs = yaml_text_docs("helm template", &text);
    let kinds: BTreeSet<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    for k in (KINDS.into_iter())
        .chain(MONITORING_KINDS)
        .chain(["PodDisruptionBudget", "Secret"])
    {
        assert!(kinds.contains(k), "no {k} in {kinds:?}");
    }
    for svc in docs.iter().filter(|d| d["kind"] == "Service") {
        let admin = array_at(svc, "/spec/ports")
            .iter()
            .any(|p| p["name"] == "admin");
        let want = if admin { "ClusterIP" } else { "LoadBalancer" };
        assert_eq!(str_at(svc, "/spec/type"), want, "{svc}");
    }
    let cfg_map = one(&docs, "ConfigMap");
    fill_token_var(&on);
    Config::from_str(str_at(cfg_map, "/data/rankgate.toml")).unwrap();
    let env = array_at(container(one(&docs, "Deployment")), "/env");
    assert!(
        env.iter().any(|e| e["name"] == "RANKGATE_ADMIN_TOKEN"),
        "{env:?}"
    );
}
