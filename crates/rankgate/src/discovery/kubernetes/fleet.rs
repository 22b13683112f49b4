//! The pods one entry sees, by name, folded from the watcher's events into the set of engines
//! to send: only when it changed, and never from a half-done re-list.

use std::collections::HashMap;

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::Event;

use super::pod::{PodState, Projector, Skip};
use crate::worker::Engine;

/// The pods seen, by name, and the set sent last.
#[derive(Debug)]
pub(super) struct Fleet {
    pub(super) view: Projector,
    pods: HashMap<String, PodState>,
    /// During a re-list (`Init` until `InitDone`): the pods listed so far, which replace
    /// `pods` whole once the list is complete.
    relisting: Option<HashMap<String, PodState>>,
    /// `None` until the first complete list, which is sent even when empty.
    sent: Option<Vec<Engine>>,
}

impl Fleet {
    pub(super) fn new(view: Projector) -> Fleet {
        Fleet {
            view,
            pods: HashMap::new(),
            relisting: None,
            sent: None,
        }
    }

    /// Folds one event in. Returns the pod's name and why, when a pod is newly skipped (it was
    /// not skipped for that same reason before), for the caller to warn once.
    pub(super) fn on(&mut self, event: Event<Pod>) -> Option<(String, Skip)> {
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
    pub(super) fn changed(&mut self) -> Option<Vec<Engine>> {
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
    use kube::runtime::watcher::Event;

    use super::super::pod::tests::{entry, pod};
    use super::super::pod::DP_SIZE_ANNOTATION;
    use super::Fleet;
    use crate::worker::Engine;

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
