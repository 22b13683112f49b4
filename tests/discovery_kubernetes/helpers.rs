//! What the Kubernetes discovery tests share: pods as the API server serves them, a kubeconfig in
//! a temporary directory pointing at the fake, and a discovery task watching it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rankgate::config::{Config, Discovery};
use rankgate::discovery::kubernetes::run;
use rankgate::worker::Engine;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::fake_api::*;

pub const NS: &str = "llm";

/// Longest wait for anything the discovery should do (kube's watcher backs off up to a few
/// seconds between attempts after an error).
pub const WAIT: Duration = Duration::from_secs(10);

/// A pod of the engine Deployment: the `http` container port is 8000.
pub fn pod(name: &str, ip: &str, ready: bool) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name, "namespace": NS, "uid": format!("uid-{name}"),
            "labels": { "app": "vllm" },
        },
        "spec": { "containers": [{
            "name": "vllm", "image": "vllm/vllm-openai",
            "ports": [
                { "name": "http", "containerPort": 8000, "protocol": "TCP" },
                { "name": "metrics", "containerPort": 9100, "protocol": "TCP" },
            ],
        }]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [
                { "type": "Initialized", "status": "True" },
                { "type": "Ready", "status": if ready { "True" } else { "False" } },
                { "type": "ContainersReady", "status": if ready { "True" } else { "False" } },
            ],
        },
    })
}

/// A temp directory holding the kubeconfig, removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!(
            "rankgate-kube-{}-{nanos}-{}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A kubeconfig for a cluster at `addr`, plain HTTP, no credentials.
pub fn write_kubeconfig(path: &Path, addr: SocketAddr) {
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{addr}\n\
         contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n\
         current-context: fake\nusers:\n- name: fake\n  user: {{}}\n"
    );
    std::fs::write(path, text).unwrap();
}

pub fn discovery(kubeconfig: &Path, extra: &str) -> Discovery {
    let text = format!(
        "[[discovery]]\nkind = \"kubernetes\"\nnamespace = \"{NS}\"\nselector = \"{SELECTOR}\"\n\
         port = \"http\"\nflavor = \"vllm\"\ndp_size = 2\nkubeconfig = {:?}\n{extra}",
        kubeconfig.display().to_string()
    );
    let mut c = Config::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    c.discovery.remove(0)
}

/// A discovery task watching `api`, its sets, and its shutdown switch.
pub struct Watching {
    pub sets: mpsc::Receiver<Vec<Engine>>,
    pub stop: watch::Sender<bool>,
    pub task: JoinHandle<()>,
    _dir: TempDir,
}

pub fn start(api: &FakeApi) -> Watching {
    let dir = TempDir::new();
    let path = dir.0.join("kubeconfig");
    write_kubeconfig(&path, api.addr);
    start_with(&path, dir)
}

pub fn start_with(kubeconfig: &Path, dir: TempDir) -> Watching {
    let (found, sets) = mpsc::channel(16);
    let (stop, shutdown) = watch::channel(false);
    let task = tokio::spawn(run(discovery(kubeconfig, ""), found, shutdown));
    Watching {
        sets,
        stop,
        task,
        _dir: dir,
    }
}

impl Watching {
    /// The next set sent, as its URLs; panics after [`WAIT`].
    pub async fn next(&mut self) -> Vec<String> {
        self.next_engines()
            .await
            .iter()
            .map(|e| e.url.to_string())
            .collect()
    }

    pub async fn next_engines(&mut self) -> Vec<Engine> {
        tokio::time::timeout(WAIT, self.sets.recv())
            .await
            .expect("a set within the wait")
            .expect("the discovery task is running")
    }
}
