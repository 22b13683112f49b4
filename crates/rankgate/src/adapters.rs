//! LoRA adapters on one rank, as this router knows them: the adapters it has requests in flight
//! for there, and how many of each. An engine core runs at most `max_loras` distinct adapters in
//! a batch at once; a request for another waits for a slot (vLLM passes over it until one
//! frees), and an adapter not in a slot costs a load. So a request for an adapter goes where it
//! runs now, else where a slot is free (`policy/adapters.rs`).
//!
//! vLLM's own gauge (`vllm:lora_requests_info`) has no rank label, so with data parallelism it
//! cannot say which rank runs what: the requests this router sent are what it knows per rank.
//! Only requests that name an adapter touch this; the list holds one entry per adapter with
//! requests in flight here, and the [`REMEMBERED_IDLE`] used most lately besides, whose last use
//! says which adapter a server at its limit unloads first (`crate::adapter_loads`).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// Adapters whose last request here ended that are remembered, for how recently each was used
/// ([`Adapters::last_use`]): the most recent this many, beside those running.
const REMEMBERED_IDLE: usize = 64;

/// One adapter used here: its requests in flight, and when one last started or ended.
#[derive(Debug)]
struct Use {
    name: Arc<str>,
    running: u32,
    at: Instant,
}

/// One rank's adapters with requests in flight from this router, and the ones used lately.
#[derive(Debug, Default)]
pub struct Adapters(Mutex<Vec<Use>>);

impl Adapters {
    fn lock(&self) -> MutexGuard<'_, Vec<Use>> {
        // Each statement leaves the list whole: a panic elsewhere leaves it usable.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A request for `adapter` starts here.
    pub fn hold(&self, adapter: &Arc<str>) {
        let mut list = self.lock();
        let at = Instant::now();
        match list.iter_mut().find(|u| u.name == *adapter) {
            Some(u) => (u.running, u.at) = (u.running + 1, at),
            None => list.push(Use {
                name: adapter.clone(),
                running: 1,
                at,
            }),
        }
    }

    /// A request for `adapter` here ended.
    pub fn release(&self, adapter: &str) {
        let mut list = self.lock();
        let Some(u) = list.iter_mut().find(|u| &*u.name == adapter) else {
            return;
        };
        u.running = u.running.saturating_sub(1);
        u.at = Instant::now();
        if u.running == 0 && list.iter().filter(|u| u.running == 0).count() > REMEMBERED_IDLE {
            // The least recently used idle one goes.
            let oldest = (list.iter().enumerate())
                .filter(|(_, u)| u.running == 0)
                .min_by_key(|(_, u)| u.at)
                .map(|(i, _)| i);
            if let Some(i) = oldest {
                list.swap_remove(i);
            }
        }
    }

    /// Whether `adapter` runs here now, and how many distinct adapters do.
    pub fn state(&self, adapter: &str) -> (bool, usize) {
        let list = self.lock();
        let running = list.iter().filter(|u| u.running > 0);
        (
            running.clone().any(|u| &*u.name == adapter),
            running.count(),
        )
    }

    /// `adapter`'s requests in flight here and when one last started or ended; `None`: not
    /// used lately.
    pub fn last_use(&self, adapter: &str) -> Option<(u32, Instant)> {
        let list = self.lock();
        let u = list.iter().find(|u| &*u.name == adapter)?;
        Some((u.running, u.at))
    }

    /// The adapters running here, with their requests in flight (for `/workers`).
    pub fn running(&self) -> Vec<(Arc<str>, u32)> {
        (self.lock().iter())
            .filter(|u| u.running > 0)
            .map(|u| (u.name.clone(), u.running))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_each_adapter_and_forgets_it_when_its_last_request_ends() {
        let a = Adapters::default();
        let (x, y): (Arc<str>, Arc<str>) = ("x".into(), "y".into());
        assert_eq!(a.state("x"), (false, 0));
        a.hold(&x);
        a.hold(&x);
        a.hold(&y);
        assert_eq!(a.state("x"), (true, 2));
        a.release("x");
        assert_eq!(a.state("x"), (true, 2));
        a.release("x");
        assert_eq!(a.state("x"), (false, 1));
        // A release for an adapter not held changes nothing.
        a.release("z");
        assert_eq!(a.running(), vec![(y, 1)]);
        // An adapter whose last request ended is remembered as used lately.
        assert_eq!(a.last_use("x").map(|(n, _)| n), Some(0));
        assert_eq!(a.last_use("z"), None);
    }

    #[test]
    fn remembers_a_bounded_number_of_idle_adapters_dropping_the_oldest() {
        let a = Adapters::default();
        let names: Vec<Arc<str>> = (0..=REMEMBERED_IDLE)
            .map(|i| format!("a{i}").into())
            .collect();
        for n in &names {
            a.hold(n);
            a.release(n);
        }
        assert_eq!(a.lock().len(), REMEMBERED_IDLE);
        assert_eq!(a.last_use("a0"), None);
        assert!(a.last_use(&names[REMEMBERED_IDLE]).is_some());
    }
}
