//! Kubernetes discovery: every Ready pod of a namespace that matches a label selector is an
//! engine at its pod IP and container port (`[[discovery]] kind = "kubernetes"`).
//!
//! It watches rather than polls: kube-rs's `watcher` lists the pods, then watches from the
//! list's resourceVersion, and lists again by itself when the API server answers 410 Gone (the
//! watch expired) or the stream desyncs. A pod that turns Ready joins within the watch's latency,
//! and the API server carries one long request per router instead of a list every few seconds.
//!
//! Each pod is projected on arrival onto what it contributes ([`PodState`]), so the map kept is
//! small and a problem with a pod (a missing named port, a bad annotation) is warned about once,
//! when it appears, not on every event. The set sent is the Ready pods' engines sorted by URL,
//! and only when it changed. A re-list collects the listed pods aside and swaps them in whole
//! when the list is complete: membership never sees the half-listed fleet of a re-list.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};

use super::Found;
use crate::config::{Discovery, DiscoverySource as Source, EngineTemplate, Overrides, PortRef};
use crate::http::{shutdown_signalled, Shutdown};
use crate::worker::Engine;

/// Pod annotation giving the engine's `dp_size` (else the entry's).
pub const DP_SIZE_ANNOTATION: &str = "rankgate.io/dp-size";
/// Pod annotation giving the engine's `start_rank` (else the entry's).
pub const START_RANK_ANNOTATION: &str = "rankgate.io/start-rank";
/// Pod annotation naming the multi-server DP deployment the pod's engine is a member of (else
/// the entry's `dp_group`).
pub const DP_GROUP_ANNOTATION: &str = "rankgate.io/dp-group";

/// First wait before building a client again after a failure; it doubles up to the cap.
const CLIENT_RETRY_FIRST: Duration = Duration::from_millis(500);
/// Longest wait between two attempts to build a client.
const CLIENT_RETRY_MAX: Duration = Duration::from_secs(5);
/// Most watch events folded before the set is computed: a rollout that changes many pods at
/// once sends one set, not one per pod.
const BATCH: usize = 256;

/// Watches the pods of `d` (a `Source::Kubernetes` entry) and sends the set of engines they are
/// on `found` each time it changes, until `shutdown` or until `found`'s receiver is gone.
///
/// The client comes from `kubeconfig` when set, else from kube's inference (`KUBECONFIG` or
/// `~/.kube/config`, then the in-cluster service account). Failing to build it, or to reach the
/// API server, is logged and retried; the last set sent stands meanwhile.
pub async fn run(d: Discovery, found: Found, mut shutdown: Shutdown) {
    let Source::Kubernetes {
        namespace,
        selector,
        port,
        grpc_port,
        kubeconfig,
    } = &d.source
    else {
        tracing::error!(at = %d.at, "not a kubernetes discovery entry; not watched");
        return;
    };
    let fleet = Fleet::new(Projector {
        at: d.at.clone(),
        namespace: namespace.clone(),
        port: port.clone(),
        grpc_port: grpc_port.clone(),
        template: d.template.clone(),
    });
    let work = async {
        let client = connect(&d.at, kubeconfig.as_deref()).await;
        let api: Api<Pod> = Api::namespaced(client, namespace);
        watch(&d.at, api, selector, fleet, &found).await;
    };
    // Dropping `work` drops the watch request with it: shutdown needs nothing else.
    tokio::select! {
        () = shutdown_signalled(&mut shutdown) => {}
        () = found.closed() => {}
        () = work => {}
    }
}

/// A client, once one can be built; retried (with a capped backoff) until then. The loop is
/// bounded by the caller's shutdown, as the entry cannot do anything else meanwhile.
async fn connect(at: &str, kubeconfig: Option<&Path>) -> Client {
    let mut wait = CLIENT_RETRY_FIRST;
    let mut last_error: Option<String> = None;
    loop {
        match client(kubeconfig).await {
            Ok(client) => {
                if last_error.is_some() {
                    tracing::info!(at, "kubernetes client built");
                }
                return client;
            }
            Err(err) => {
                // Once per distinct error, not once per retry: a missing kubeconfig stays missing.
                if last_error.as_deref() != Some(&err) {
                    tracing::error!(at, error = %err, retry_in_ms = wait.as_millis() as u64, "cannot build a kubernetes client; no pods are watched");
                } else {
                    tracing::debug!(at, error = %err, "kubernetes client still failing");
                }
                last_error = Some(err);
            }
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(CLIENT_RETRY_MAX);
    }
}

/// kube's `Config` carries its own connect (30 s) and read (295 s, past the watch's 290 s
/// server-side timeout) timeouts, so an API server that goes silent fails the watch, which is
/// then retried, instead of hanging it.
async fn client(kubeconfig: Option<&Path>) -> Result<Client, String> {
    let config = match kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path).map_err(|e| e.to_string())?;
            kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .map_err(|e| format!("kubeconfig {}: {e}", path.display()))?
        }
        None => kube::Config::infer().await.map_err(|e| e.to_string())?,
    };
    Client::try_from(config).map_err(|e| e.to_string())
}

/// Folds the watcher's events into `fleet` and sends each changed set. The watcher's stream
/// never ends (it retries, with kube's default backoff, on every error), so the loop is bounded
/// by shutdown or the receiver going away, which the caller selects on.
async fn watch(at: &str, api: Api<Pod>, selector: &str, mut fleet: Fleet, found: &Found) {
    let config = watcher::Config::default().labels(selector);
    let events = watcher::watcher(api, config)
        .default_backoff()
        .ready_chunks(BATCH);
    let mut events = std::pin::pin!(events);
    let mut failing = false;
    while let Some(batch) = events.next().await {
        for item in batch {
            match item {
                Ok(event) => {
                    // `Init` is emitted before the list is even asked for: not a sign of health.
                    if failing && !matches!(event, Event::Init) {
                        tracing::info!(at, "watching pods again");
                        failing = false;
                    }
                    if let Some((pod, skip)) = fleet.on(event) {
                        tracing::warn!(at, pod = %format!("{}/{pod}", fleet.view.namespace), reason = %skip, "pod skipped: not an engine until this is fixed");
                    }
                }
                // The watch outlived the API server's history: routine, the watcher re-lists.
                Err(watcher::Error::WatchError(e)) if e.code == 410 => {
                    tracing::debug!(at, "pod watch expired; listing again");
                }
                Err(err) => {
                    if !failing {
                        tracing::warn!(at, error = %err, "watching pods failed; keeping the engines last found, retrying");
                        failing = true;
                    } else {
                        tracing::debug!(at, error = %err, "watching pods still failing");
                    }
                }
            }
        }
        if let Some(set) = fleet.changed() {
            if found.send(set).await.is_err() {
                return;
            }
        }
    }
}

/// What one pod contributes now.
#[derive(Debug, Clone, PartialEq)]
enum PodState {
    /// Ready, addressed and valid.
    Engine(Engine),
    /// Not Ready, being deleted or without an IP yet: nothing to serve, nothing to warn about.
    Waiting,
    /// Cannot be an engine as it is declared (warned about once).
    Skipped(Skip),
}

/// Why a pod is not an engine though it may be Ready.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum Skip {
    #[error("no container declares a port named {0:?}")]
    NoPort(String),
    #[error("container port {name:?} is {number}, not a port number")]
    BadPort { name: String, number: i32 },
    #[error("annotation {key}: {value:?} is not a whole number")]
    BadAnnotation { key: &'static str, value: String },
    #[error("status.podIP {0:?} is not an IP address")]
    BadIp(String),
    /// The engine the pod would be fails the `[[engines]]` rules (e.g. `dp-size` 0).
    #[error("{0}")]
    Invalid(String),
}

/// Turns a pod into what it contributes, by the entry's ports and engine keys.
#[derive(Debug)]
struct Projector {
    at: String,
    namespace: String,
    port: Option<PortRef>,
    grpc_port: Option<PortRef>,
    template: EngineTemplate,
}

impl Projector {
    fn project(&self, pod: &Pod) -> PodState {
        match self.try_project(pod) {
            Ok(Some(engine)) => PodState::Engine(engine),
            Ok(None) => PodState::Waiting,
            Err(skip) => PodState::Skipped(skip),
        }
    }

    /// What the spec declares is checked before readiness, so a mistake is reported when the
    /// pod appears, not when it is finally Ready and still missing from the fleet.
    fn try_project(&self, pod: &Pod) -> Result<Option<Engine>, Skip> {
        let port = self.port.as_ref().map(|p| port_of(pod, p)).transpose()?;
        let grpc_port = self
            .grpc_port
            .as_ref()
            .map(|p| port_of(pod, p))
            .transpose()?;
        let found = Overrides {
            dp_size: annotation(pod, DP_SIZE_ANNOTATION)?,
            start_rank: annotation(pod, START_RANK_ANNOTATION)?,
            dp_group: (pod.metadata.annotations.as_ref())
                .and_then(|a| a.get(DP_GROUP_ANNOTATION))
                .map(|g| g.trim().to_string()),
        };
        let Some(ip) = serving_ip(pod) else {
            return Ok(None);
        };
        let ip: IpAddr = ip.parse().map_err(|_| Skip::BadIp(ip.to_string()))?;
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let at = format!("{} pod {}/{name}", self.at, self.namespace);
        self.template
            .engine(&at, ip, port, grpc_port, found)
            .map(Some)
            .map_err(|e| Skip::Invalid(e.to_string()))
    }
}

/// The pod's IP when it should receive traffic: Ready (condition `Ready` is `True`) and not
/// being deleted (a terminating pod can stay Ready for its whole grace period while it drains).
fn serving_ip(pod: &Pod) -> Option<&str> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let ip = status.pod_ip.as_deref().filter(|ip| !ip.is_empty())?;
    ready.then_some(ip)
}

/// A port number as is, a port name through the pod's containers' declared ports.
fn port_of(pod: &Pod, port: &PortRef) -> Result<u16, Skip> {
    let name = match port {
        PortRef::Number(n) => return Ok(*n),
        PortRef::Name(name) => name,
    };
    let declared = pod
        .spec
        .iter()
        .flat_map(|s| &s.containers)
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some(name.as_str()))
        .ok_or_else(|| Skip::NoPort(name.clone()))?;
    u16::try_from(declared.container_port)
        .ok()
        .filter(|&n| n != 0)
        .ok_or_else(|| Skip::BadPort {
            name: name.clone(),
            number: declared.container_port,
        })
}

/// A numeric annotation; absent is `None` (the entry's value then applies).
fn annotation(pod: &Pod, key: &'static str) -> Result<Option<u32>, Skip> {
    let Some(value) = pod.metadata.annotations.as_ref().and_then(|a| a.get(key)) else {
        return Ok(None);
    };
    value
        .trim()
        .parse()
        .map(Some)
        .map_err(|_| Skip::BadAnnotation {
            key,
            value: value.clone(),
        })
}

/// The pods seen, by name, and the set sent last.
#[derive(Debug)]
struct Fleet {
    view: Projector,
    pods: HashMap<String, PodState>,
    /// During a re-list (`Init` until `InitDone`): the pods listed so far, which replace
    /// `pods` whole once the list is complete.
    relisting: Option<HashMap<String, PodState>>,
    /// `None` until the first complete list, which is sent even when empty.
    sent: Option<Vec<Engine>>,
}

impl Fleet {
    fn new(view: Projector) -> Fleet {
        Fleet {
            view,
            pods: HashMap::new(),
            relisting: None,
            sent: None,
        }
    }

    /// Folds one event in. Returns the pod's name and why, when a pod is newly skipped (it was
    /// not skipped for that same reason before), for the caller to warn once.
    fn on(&mut self, event: Event<Pod>) -> Option<(String, Skip)> {
        let (pod, relisted) = match event {
            Event::Init => {
                self.relisting = Some(HashMap::new());
                return None;
            }
            Event::InitDone => {
                if let Some(listed) = self.relisting.take() {
                    self.pods = listed;
                }
                return None;
            }
            Event::Delete(pod) => {
                if let Some(name) = pod.metadata.name.as_deref() {
                    self.pods.remove(name);
                }
                return None;
            }
            Event::Apply(pod) => (pod, false),
            Event::InitApply(pod) => (pod, true),
        };
        let name = pod.metadata.name.clone()?;
        let state = self.view.project(&pod);
        // Compared with what the pod was before this event (or before the re-list).
        let news = match &state {
            PodState::Skipped(skip) if self.pods.get(&name) != Some(&state) => {
                Some((name.clone(), skip.clone()))
            }
            _ => None,
        };
        match self.relisting.as_mut() {
            Some(listed) if relisted => listed.insert(name, state),
            _ => self.pods.insert(name, state),
        };
        news
    }

    /// The set to send: the Ready pods' engines sorted by URL, when it differs from the last
    /// sent, and never in the middle of a re-list.
    fn changed(&mut self) -> Option<Vec<Engine>> {
        if self.relisting.is_some() {
            return None;
        }
        let mut set: Vec<Engine> = self
            .pods
            .values()
            .filter_map(|p| match p {
                PodState::Engine(e) => Some(e.clone()),
                _ => None,
            })
            .collect();
        set.sort_by(|a, b| a.url.cmp(&b.url));
        // Two pods on one address (host networking) are one server: membership keys by URL.
        set.dedup_by(|a, b| a.url == b.url);
        if self.sent.as_ref() == Some(&set) {
            return None;
        }
        self.sent = Some(set.clone());
        Some(set)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn entry(keys: &str) -> Projector {
        let c = Config::from_str(&format!(
            "[[discovery]]\nkind = \"kubernetes\"\nnamespace = \"llm\"\nselector = \"app=vllm\"\nflavor = \"vllm\"\n{keys}"
        ))
        .unwrap();
        let d = &c.discovery[0];
        let Source::Kubernetes {
            port, grpc_port, ..
        } = &d.source
        else {
            panic!("{d:?}")
        };
        Projector {
            at: d.at.clone(),
            namespace: "llm".into(),
            port: port.clone(),
            grpc_port: grpc_port.clone(),
            template: d.template.clone(),
        }
    }

    fn pod(name: &str, ready: bool, ip: &str, annotations: &[(&str, &str)]) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name,
                "namespace": "llm",
                "annotations": annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<HashMap<_, _>>(),
            },
            "spec": { "containers": [
                { "name": "sidecar", "ports": [{ "name": "metrics", "containerPort": 9090 }] },
                { "name": "engine", "ports": [
                    { "name": "http", "containerPort": 8000 },
                    { "name": "grpc", "containerPort": 50051 },
                ]},
            ]},
            "status": {
                "podIP": ip,
                "conditions": [
                    { "type": "PodScheduled", "status": "True" },
                    { "type": "Ready", "status": if ready { "True" } else { "False" } },
                ],
            },
        }))
        .unwrap()
    }

    fn engine(state: PodState) -> Engine {
        match state {
            PodState::Engine(e) => e,
            s => panic!("{s:?}"),
        }
    }

    #[test]
    fn a_ready_pod_is_an_engine_at_its_named_ports() {
        let p = entry("port = \"http\"\ngrpc_port = \"grpc\"\ndp_size = 2");
        let e = engine(p.project(&pod("vllm-0", true, "127.0.0.7", &[])));
        assert_eq!(&*e.url, "http://127.0.0.7:8000");
        assert_eq!(e.grpc.as_deref(), Some("127.0.0.7:50051"));
        assert_eq!((e.dp_size, e.start_rank), (2, 0));
        // A number is used as is, declared or not.
        let p = entry("port = 8123");
        let e = engine(p.project(&pod("vllm-0", true, "fd00::7", &[])));
        assert_eq!(&*e.url, "http://[fd00::7]:8123");
    }

    #[test]
    fn readiness_deletion_and_ip_decide() {
        let p = entry("port = \"http\"");
        assert_eq!(
            p.project(&pod("a", false, "127.0.0.7", &[])),
            PodState::Waiting
        );
        assert_eq!(p.project(&pod("a", true, "", &[])), PodState::Waiting);
        let mut no_status = pod("a", true, "127.0.0.7", &[]);
        no_status.status = None;
        assert_eq!(p.project(&no_status), PodState::Waiting);
        let mut deleting = pod("a", true, "127.0.0.7", &[]);
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2025-01-01T00:00:00Z".parse().unwrap(),
            ));
        assert_eq!(p.project(&deleting), PodState::Waiting);
        assert_eq!(
            p.project(&pod("a", true, "not-an-ip", &[])),
            PodState::Skipped(Skip::BadIp("not-an-ip".into()))
        );
    }

    #[test]
    fn annotations_override_the_entry() {
        let p = entry("port = \"http\"\ndp_size = 2\nstart_rank = 0");
        let e = engine(p.project(&pod(
            "a",
            true,
            "127.0.0.7",
            &[(DP_SIZE_ANNOTATION, "8"), (START_RANK_ANNOTATION, " 16 ")],
        )));
        assert_eq!((e.dp_size, e.start_rank), (8, 16));
        // The members of one deployment spread over pods name it.
        let e = engine(p.project(&pod(
            "a",
            true,
            "127.0.0.7",
            &[
                (START_RANK_ANNOTATION, "2"),
                (DP_GROUP_ANNOTATION, " llama "),
            ],
        )));
        assert_eq!(
            e.deployment,
            crate::worker::Deployment::Member {
                group: Some("llama".into())
            }
        );
        assert_eq!(
            p.project(&pod(
                "a",
                true,
                "127.0.0.7",
                &[(DP_SIZE_ANNOTATION, "eight")]
            )),
            PodState::Skipped(Skip::BadAnnotation {
                key: DP_SIZE_ANNOTATION,
                value: "eight".into()
            })
        );
        // Parsed, but not a valid engine: the `[[engines]]` rules name the pod.
        match p.project(&pod("a", true, "127.0.0.7", &[(DP_SIZE_ANNOTATION, "0")])) {
            PodState::Skipped(Skip::Invalid(why)) => {
                assert!(why.contains("discovery[0] pod llm/a"), "{why}")
            }
            s => panic!("{s:?}"),
        }
        // A bad annotation is reported before the pod is even Ready.
        assert!(matches!(
            p.project(&pod("a", false, "", &[(START_RANK_ANNOTATION, "-1")])),
            PodState::Skipped(Skip::BadAnnotation { .. })
        ));
    }

    #[test]
    fn a_missing_port_name_skips_the_pod() {
        let p = entry("port = \"openai\"");
        assert_eq!(
            p.project(&pod("a", true, "127.0.0.7", &[])),
            PodState::Skipped(Skip::NoPort("openai".into()))
        );
    }

    #[test]
    fn sets_are_sent_on_change_and_never_mid_relist() {
        let mut f = Fleet::new(entry("port = \"http\""));
        assert_eq!(f.on(Event::Init), None);
        f.on(Event::InitApply(pod("a", true, "127.0.0.1", &[])));
        assert_eq!(f.changed(), None, "a partial list is not sent");
        f.on(Event::InitApply(pod("b", false, "127.0.0.2", &[])));
        f.on(Event::InitDone);
        let urls = |s: Vec<Engine>| s.iter().map(|e| e.url.to_string()).collect::<Vec<_>>();
        assert_eq!(urls(f.changed().unwrap()), ["http://127.0.0.1:8000"]);
        assert_eq!(f.changed(), None, "unchanged: not sent again");
        f.on(Event::Apply(pod("b", true, "127.0.0.2", &[])));
        assert_eq!(
            urls(f.changed().unwrap()),
            ["http://127.0.0.1:8000", "http://127.0.0.2:8000"]
        );
        // A re-list: `a` is gone, `c` is new; the old set stands until the list is done.
        f.on(Event::Init);
        f.on(Event::InitApply(pod("c", true, "127.0.0.3", &[])));
        assert_eq!(f.changed(), None);
        f.on(Event::InitApply(pod("b", true, "127.0.0.2", &[])));
        f.on(Event::InitDone);
        assert_eq!(
            urls(f.changed().unwrap()),
            ["http://127.0.0.2:8000", "http://127.0.0.3:8000"]
        );
        f.on(Event::Delete(pod("b", true, "127.0.0.2", &[])));
        assert_eq!(urls(f.changed().unwrap()), ["http://127.0.0.3:8000"]);
    }

    #[test]
    fn an_empty_first_list_is_sent() {
        let mut f = Fleet::new(entry("port = 8000"));
        f.on(Event::Init);
        f.on(Event::InitDone);
        assert_eq!(f.changed(), Some(vec![]));
        assert_eq!(f.changed(), None);
    }

    #[test]
    fn a_skipped_pod_is_reported_once_per_reason() {
        let mut f = Fleet::new(entry("port = \"http\""));
        let bad = |v: &str| pod("a", true, "127.0.0.1", &[(DP_SIZE_ANNOTATION, v)]);
        f.on(Event::Init);
        let (name, skip) = f.on(Event::InitApply(bad("x"))).unwrap();
        assert_eq!(name, "a");
        assert!(skip.to_string().contains("\"x\""), "{skip}");
        f.on(Event::InitDone);
        assert_eq!(f.on(Event::Apply(bad("x"))), None);
        // The same pod, still wrong after a re-list: not reported again.
        f.on(Event::Init);
        assert_eq!(f.on(Event::InitApply(bad("x"))), None);
        f.on(Event::InitDone);
        // Wrong in a new way: reported.
        assert!(f.on(Event::Apply(bad("y"))).is_some());
        // Fixed, then broken again: reported again.
        assert_eq!(f.on(Event::Apply(bad("2"))), None);
        assert!(f.on(Event::Apply(bad("y"))).is_some());
        assert_eq!(f.changed(), Some(vec![]));
    }
}
