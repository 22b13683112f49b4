//! Kubernetes discovery against a fake API server over real HTTP on 127.0.0.1:0, reached through
//! a kubeconfig file like any cluster. The fake answers what kube's watcher asks, in the shapes a
//! real API server uses: a paginated PodList carrying a resourceVersion, then a chunked watch
//! stream of newline-delimited events replayed from the asked resourceVersion, and for a watch
//! from a compacted resourceVersion an `ERROR` event with a 410 `Expired` Status.
//!
//! By part: [`fake_api`] (the fake API server), [`events`] (lists and watch events) and
//! [`lifecycle`] (the task's end, a late kubeconfig, a router's fleet), over [`helpers`].
#![cfg(feature = "kubernetes")]

#[path = "../common/mod.rs"]
mod common;
mod events;
mod fake_api;
mod helpers;
mod lifecycle;
