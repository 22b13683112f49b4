//! A request's charge to its tenant while its answer streams: the output tokens, as they pass
//! (an SSE event is a token or a few; any other body is counted at four bytes a token), and the
//! tenant's request in flight, which ends when the answer does and wakes the queue.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use bytes::Bytes;
use http_body::Frame;
use tokio::sync::Notify;

use super::queue::Tenant;

/// What a request's end tells the queue: room may have appeared. Only a queue with requests
/// waiting is woken; else a request's end costs an atomic load.
#[derive(Debug, Default)]
pub struct Wake {
    /// Requests waiting (kept by the queue).
    pub waiting: std::sync::atomic::AtomicUsize,
    pub kick: Notify,
}

/// A request on its way from the queue to its pick: counted against the fleet's room until
/// dropped.
#[derive(Debug)]
pub struct Pending(pub(super) Arc<std::sync::atomic::AtomicU64>);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// Bytes of a non-SSE answer counted as one token.
const BYTES_PER_TOKEN: usize = 4;

#[derive(Debug)]
pub struct Charge {
    pub tenant: Arc<Tenant>,
    pub band: usize,
    pub weight: f64,
    pub wake: Arc<Wake>,
    /// The request counted against the fleet's room on its way to its pick (flow's future
    /// drops it after its first poll): carried here, so that future is one pointer larger only.
    pub pending: Option<Pending>,
}

impl Charge {
    /// A request of `tenant` in flight from now until this is dropped.
    pub fn start(tenant: Arc<Tenant>, band: usize, weight: f64, wake: &Arc<Wake>) -> Box<Charge> {
        tenant.in_flight.fetch_add(1, Relaxed);
        Box::new(Charge {
            tenant,
            band,
            weight,
            wake: wake.clone(),
            pending: None,
        })
    }

    /// Charges the output in `frame`.
    #[inline]
    pub fn passed(&self, frame: &Frame<Bytes>) {
        let Some(data) = frame.data_ref() else {
            return;
        };
        // An event stream's frames start with an event (vLLM and SGLang send one a frame).
        let tokens = match data.starts_with(b"data:") {
            true => data.windows(5).filter(|w| w == b"data:").count(),
            false => data.len().div_ceil(BYTES_PER_TOKEN),
        };
        if tokens > 0 {
            (self.tenant).charge(self.band, tokens as u64, self.weight);
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.tenant.in_flight.fetch_sub(1, Relaxed);
        // A request ended: room may have appeared for one that waits.
        if self.wake.waiting.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            self.wake.kick.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_count_as_tokens_and_other_bodies_by_bytes() {
        let wake = Arc::new(Wake::default());
        let t = Arc::new(Tenant::for_tests("t"));
        let c = Charge::start(t.clone(), 0, 1.0, &wake);
        assert_eq!(t.in_flight.load(Relaxed), 1);
        c.passed(&Frame::data(Bytes::from_static(
            b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\n",
        )));
        assert_eq!(t.tokens.load(Relaxed), 2);
        c.passed(&Frame::data(Bytes::from_static(b"12345678")));
        assert_eq!(t.tokens.load(Relaxed), 4);
        drop(c);
        assert_eq!(t.in_flight.load(Relaxed), 0);
    }
}
