//! Kubernetes discovery: every Ready pod of a namespace that matches a label selector is an
//! engine at its pod IP and container port (`[[discovery]] kind = "kubernetes"`).
//!
//! It watches rather than polls: kube-rs's `watcher` lists the pods, then watches from the
//! list's resourceVersion, and lists again by itself when the API server answers 410 Gone (the
//! watch expired) or the stream desyncs. A pod that turns Ready joins within the watch's latency,
//! and the API server carries one long request per router instead of a list every few seconds.
//!
//! Each pod is projected on arrival onto what it contributes (`pod::PodState`), so the map kept is
//! small and a problem with a pod (a missing named port, a bad annotation) is warned about once,
//! when it appears, not on every event. The set sent is the Ready pods' engines sorted by URL,
//! and only when it changed. A re-list collects the listed pods aside and swaps them in whole
//! when the list is complete: membership never sees the half-listed fleet of a re-list.

mod fleet;
mod pod;

use std::path::Path;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};

use super::found::Found;
use crate::config::{Discovery, DiscoverySource as Source};
use crate::http::{shutdown_signalled, Shutdown};

use fleet::Fleet;
use pod::Projector;
pub use pod::{DP_GROUP_ANNOTATION, DP_SIZE_ANNOTATION, START_RANK_ANNOTATION};

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
