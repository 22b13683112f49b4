//! Reading the deployment material for tests/deploy/ and tests/deploy_kustomize.rs: files under
//! the repository root as text and YAML documents (as JSON values), the resources the base
//! kustomization lists, the ConfigMap's `rankgate.toml` as a validated config, and a bounded
//! runner for the outside tools (docker, kubectl) some ignored tests call.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rankgate::config::Config;
use serde::Deserialize;
use serde_json::Value;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn read(rel: &str) -> String {
    let p = root().join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// Every YAML document of a text, as JSON values (empty documents left out); `what` names it
/// in errors.
pub fn yaml_text_docs(what: &str, text: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{what}: {e}")))
        .filter(|v| !v.is_null())
        .collect()
}

/// Every YAML document of a file, as JSON values (empty documents left out).
pub fn yaml_docs(rel: &str) -> Vec<Value> {
    yaml_text_docs(rel, &read(rel))
}

pub const KUBE: &str = "deploy/kubernetes";

/// The optional Prometheus Operator objects, a kustomize Component under [`KUBE`].
pub const MONITORING: &str = "deploy/kubernetes/components/monitoring";

/// The files `kubectl apply -k deploy/kubernetes` creates objects from (the Helm chart creates
/// these too). The admin token's Secret is generated (`secretGenerator`), not a file.
pub const KINDS: [&str; 6] = [
    "ConfigMap",
    "Deployment",
    "Role",
    "RoleBinding",
    "Service",
    "ServiceAccount",
];

/// What the monitoring Component adds (the Helm chart's `serviceMonitor` and `prometheusRule`).
pub const MONITORING_KINDS: [&str; 2] = ["ServiceMonitor", "PrometheusRule"];

/// The one document of a kustomization (or Component) file in `dir`.
pub fn kustomization(dir: &str) -> Value {
    let k = yaml_docs(&format!("{dir}/kustomization.yaml"));
    assert_eq!(k.len(), 1, "{dir}/kustomization.yaml holds one document");
    k.into_iter().next().unwrap()
}

/// The resources a kustomization in `dir` lists, parsed, in its order.
pub fn resources_of(dir: &str) -> Vec<Value> {
    let k = kustomization(dir);
    let resources = k["resources"]
        .as_array()
        .unwrap_or_else(|| panic!("{dir}/kustomization.yaml lists resources"));
    resources
        .iter()
        .flat_map(|r| yaml_docs(&format!("{dir}/{}", r.as_str().expect("resource path"))))
        .collect()
}

/// The resources the base `kustomization.yaml` lists, parsed, in its order.
pub fn manifests() -> Vec<Value> {
    resources_of(KUBE)
}

/// The one resource of this kind (panics on none or several).
pub fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = docs.iter().filter(|d| d["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "expected one {kind}, found {}", found.len());
    found[0]
}

/// The Service named `name` (the front door `rankgate`, or `rankgate-admin`).
pub fn service<'a>(docs: &'a [Value], name: &str) -> &'a Value {
    let found: Vec<&Value> = (docs.iter())
        .filter(|d| d["kind"] == "Service" && d["metadata"]["name"] == name)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "expected one Service {name}, found {}",
        found.len()
    );
    found[0]
}

pub fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {pointer} in {v}"))
}

pub fn array_at<'a>(v: &'a Value, pointer: &str) -> &'a Vec<Value> {
    v.pointer(pointer)
        .and_then(Value::as_array)
        .unwrap_or_else(|| panic!("no array at {pointer} in {v}"))
}

/// The Deployment's one container.
pub fn container(deploy: &Value) -> &Value {
    let cs = array_at(deploy, "/spec/template/spec/containers");
    assert_eq!(cs.len(), 1, "one container in the rankgate pod");
    &cs[0]
}

/// A port given by number or by the name of one of the container's ports, as a number.
pub fn resolve_port(container: &Value, port: &Value) -> u16 {
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
pub fn configmap_file(docs: &[Value]) -> (String, String) {
    let data = one(docs, "ConfigMap")["data"]
        .as_object()
        .expect("ConfigMap data");
    assert_eq!(data.len(), 1, "the ConfigMap holds one file");
    let (name, text) = data.iter().next().unwrap();
    (name.clone(), text.as_str().expect("file text").to_string())
}

/// What the tests put in the variable the config's `server.admin_token_env` names, where the
/// Deployment has the Secret's token.
pub const TEST_ADMIN_TOKEN: &str = "deploy-test-admin-token";

/// The variable `text`'s `server.admin_token_env` names, if any.
pub fn token_var(text: &str) -> Option<String> {
    let raw: toml::Table = toml::from_str(text).expect("TOML");
    let var = raw.get("server")?.get("admin_token_env")?;
    Some(
        var.as_str()
            .expect("admin_token_env is a string")
            .to_string(),
    )
}

/// Fills the admin token's variable as the pod's environment does: rankgate refuses a config
/// whose `admin_token_env` names an unset variable.
pub fn fill_token_var(text: &str) {
    if let Some(var) = token_var(text) {
        if std::env::var(&var).ok().as_deref() != Some(TEST_ADMIN_TOKEN) {
            std::env::set_var(var, TEST_ADMIN_TOKEN);
        }
    }
}

pub fn config(docs: &[Value]) -> Config {
    let (name, text) = configmap_file(docs);
    assert_eq!(name, "rankgate.toml");
    fill_token_var(&text);
    Config::from_str(&text).unwrap_or_else(|e| panic!("the ConfigMap's {name}: {e}\n{text}"))
}

/// The three listeners' ports: front door, admin, gRPC.
pub fn config_ports(cfg: &Config) -> [u16; 3] {
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

/// The ConfigMap's config text, pointed at `engine_url` instead of the engine it names, which
/// must be a single vLLM engine; its listeners are still the pod's.
pub fn config_text_for_test(docs: &[Value], engine_url: &str) -> String {
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
    text.replace(&quoted, &format!("\"{engine_url}\""))
}

/// The ConfigMap's config, moved onto 127.0.0.1:0 and pointed at `engine_url` instead of the
/// engine it names (see [`config_text_for_test`]).
pub fn config_for_test(docs: &[Value], engine_url: &str) -> Config {
    let text = config_text_for_test(docs, engine_url);
    fill_token_var(&text);
    let mut cfg = Config::from_str(&text).expect("the rewritten config");
    let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
    cfg.server.listen = loopback;
    cfg.server.admin_listen = loopback;
    cfg.server.grpc_listen = cfg.server.grpc_listen.map(|_| loopback);
    cfg
}

/// Runs a command with its output sent to `log`, killing it after `limit`. `None` on timeout.
pub fn run_bounded(
    cmd: &mut Command,
    log: &Path,
    limit: Duration,
) -> Option<std::process::ExitStatus> {
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

/// The last 40 lines of a log.
pub fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Where `name` is on PATH, if it is.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}
