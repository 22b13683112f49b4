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

/// One rank's adapters with requests in flight from this router, and the ones used lately;
/// and what its engine's gauge said last.
#[derive(Debug, Default)]
pub struct Adapters {
    uses: Mutex<Vec<Use>>,
    said: Mutex<Said>,
}

/// What the engine's `vllm:lora_requests_info` said last ([`crate::telemetry`]'s reading).
#[derive(Debug, Default)]
struct Said {
    max_lora: Option<u32>,
    /// The adapters running on the engine, all its ranks together (the gauge has no rank label).
    running: Vec<Arc<str>>,
    /// The server has this one rank: what runs there runs here.
    own: bool,
}

impl Adapters {
    fn lock(&self) -> MutexGuard<'_, Vec<Use>> {
        // Each statement leaves the list whole: a panic elsewhere leaves it usable.
        self.uses.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn said(&self) -> MutexGuard<'_, Said> {
        self.said.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The engine's gauge: its `max_lora`, and the adapters running on the server, this rank's
    /// own when the server has one rank (`own`).
    pub fn engine_said(&self, max_lora: Option<u32>, running: &[Arc<str>], own: bool) {
        let mut said = self.said();
        said.max_lora = max_lora;
        said.running = running.to_vec();
        said.own = own;
    }

    /// Whether the engine's gauge says `adapter` runs on its server (on some rank of it).
    pub fn engine_runs(&self, adapter: &str) -> bool {
        self.said().running.iter().any(|n| &**n == adapter)
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

    /// Whether `adapter` runs here now, how many distinct adapters do (this router's requests
    /// and, on a server of one rank, what its engine said), and the engine's `max_lora` if it
    /// said one.
    pub fn state(&self, adapter: &str) -> (bool, usize, Option<u32>) {
        let list = self.lock();
        let said = self.said();
        let ours = || list.iter().filter(|u| u.running > 0);
        let theirs: &[Arc<str>] = match said.own {
            true => &said.running,
            false => &[],
        };
        let theirs_here = || theirs.iter();
        let theirs = theirs_here().filter(|n| !ours().any(|u| u.name == **n));
        let here = ours().any(|u| &*u.name == adapter) || theirs_here().any(|n| &**n == adapter);
        (here, ours().count() + theirs.count(), said.max_lora)
    }

    /// The engine's `max_lora`, if its gauge said one.
    pub fn max_lora_said(&self) -> Option<u32> {
        self.said().max_lora
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
        assert_eq!(a.state("x"), (false, 0, None));
        a.hold(&x);
        a.hold(&x);
        a.hold(&y);
        assert_eq!(a.state("x"), (true, 2, None));
        a.release("x");
        assert_eq!(a.state("x"), (true, 2, None));
        a.release("x");
        assert_eq!(a.state("x"), (false, 1, None));
        // A release for an adapter not held changes nothing.
        a.release("z");
        assert_eq!(a.running(), vec![(y, 1)]);
        // An adapter whose last request ended is remembered as used lately.
        assert_eq!(a.last_use("x").map(|(n, _)| n), Some(0));
        assert_eq!(a.last_use("z"), None);
    }

    #[test]
    fn the_engines_word_adds_to_what_runs_and_sets_the_slots() {
        let a = Adapters::default();
        let y: Arc<str> = "y".into();
        a.hold(&y);
        let both: [Arc<str>; 2] = ["x".into(), "y".into()];
        a.engine_said(Some(2), &both, true);
        // `y` counted once, `x` runs by the engine's word.
        assert_eq!(a.state("x"), (true, 2, Some(2)));
        // A server of several ranks: the gauge says nothing of this rank's adapters.
        a.engine_said(Some(2), &both, false);
        assert_eq!(a.state("x"), (false, 1, Some(2)));
        // It still says the adapter runs on the server: no load unloads it there.
        assert!(a.engine_runs("x"));
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
