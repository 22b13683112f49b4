//! LoRA adapters on one rank, as this router knows them: the adapters it has requests in flight
//! for there, and how many of each. An engine core runs at most `max_loras` distinct adapters in
//! a batch at once; a request for another waits for a slot (vLLM passes over it until one
//! frees), and an adapter not in a slot costs a load. So a request for an adapter goes where it
//! runs now, else where a slot is free (`policy/adapters.rs`).
//!
//! vLLM's own gauge (`vllm:lora_requests_info`) has no rank label, so with data parallelism it
//! cannot say which rank runs what: the requests this router sent are what it knows per rank.
//! Only requests that name an adapter touch this; the list holds at most one entry per adapter
//! with requests in flight here.

use std::sync::{Arc, Mutex, MutexGuard};

/// One rank's adapters with requests in flight from this router.
#[derive(Debug, Default)]
pub struct Adapters(Mutex<Vec<(Arc<str>, u32)>>);

impl Adapters {
    fn lock(&self) -> MutexGuard<'_, Vec<(Arc<str>, u32)>> {
        // Each statement leaves the list whole: a panic elsewhere leaves it usable.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A request for `adapter` starts here.
    pub fn hold(&self, adapter: &Arc<str>) {
        let mut list = self.lock();
        match list.iter_mut().find(|(a, _)| a == adapter) {
            Some((_, n)) => *n += 1,
            None => list.push((adapter.clone(), 1)),
        }
    }

    /// A request for `adapter` here ended.
    pub fn release(&self, adapter: &str) {
        let mut list = self.lock();
        if let Some(i) = list.iter().position(|(a, _)| &**a == adapter) {
            list[i].1 -= 1;
            if list[i].1 == 0 {
                list.swap_remove(i);
            }
        }
    }

    /// Whether `adapter` runs here now, and how many distinct adapters do.
    pub fn state(&self, adapter: &str) -> (bool, usize) {
        let list = self.lock();
        (list.iter().any(|(a, _)| &**a == adapter), list.len())
    }

    /// The adapters running here, with their requests in flight (for `/workers`).
    pub fn running(&self) -> Vec<(Arc<str>, u32)> {
        self.lock().clone()
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
    }
}
