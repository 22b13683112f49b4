//! The HTTP/1 connections to one engine that no request is using, kept per core.
//!
//! A request takes the connection its core used last (so the fewest stay warm) straight from
//! the core's own list: one uncontended lock, no hashing of the engine's address and no
//! checkout future, where a general-purpose pool spent about 10k instructions per request
//! (bench/instructions.sh). A connection comes back when its response body has ended cleanly,
//! and only then: one left mid-response may never be ready again (a stalled engine). Idle ones
//! go after [`IDLE_FOR`], looked at whenever a connection is taken or given back, and all of
//! them with the engine's fleet entry.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use hyper::client::conn::http1::SendRequest;

use super::RequestBody;

/// A request sender on one HTTP/1 connection to an engine.
pub type Sender = SendRequest<RequestBody>;

/// How long a connection may sit unused before it is closed: each holds its buffers, and
/// after a burst of thousands of streams they were most of the memory kept (vLLM's and
/// SGLang's servers close idle keep-alive connections after 5 s anyway).
pub const IDLE_FOR: Duration = Duration::from_secs(15);

/// One engine's idle connections: one list per core (thread-per-core runtimes), each used by
/// its own core, so the locks are never contended on the request path.
#[derive(Debug)]
pub struct Idle {
    lists: Box<[Mutex<List>]>,
}

/// One core's idle connections, each with when it was given back, oldest first.
type List = Vec<(Sender, Instant)>;

impl Default for Idle {
    fn default() -> Idle {
        Idle::new(cores())
    }
}

/// How many per-core lists an engine keeps: one per core the front door may run on.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

impl Idle {
    pub fn new(cores: usize) -> Idle {
        Idle {
            lists: (0..cores.max(1)).map(|_| Mutex::default()).collect(),
        }
    }

    fn list(&self, core: usize) -> std::sync::MutexGuard<'_, List> {
        let list = &self.lists[core % self.lists.len()];
        // A panic while holding it left nothing half-done (pushes and pops only).
        list.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The most recently used open connection of `core`'s, if any.
    pub fn take(&self, core: usize) -> Option<Sender> {
        let mut list = self.list(core);
        while let Some((sender, _)) = list.pop() {
            if !sender.is_closed() {
                return Some(sender);
            }
        }
        None
    }

    /// Keeps `sender` for the next request of `core`'s, unless its connection has closed;
    /// closes the ones unused for [`IDLE_FOR`].
    pub fn give_back(&self, core: usize, sender: Sender) {
        if sender.is_closed() {
            return;
        }
        let now = Instant::now();
        let mut list = self.list(core);
        // The oldest are first: they go while they are past their time or closed.
        let stale = list
            .iter()
            .position(|(s, since)| now.duration_since(*since) < IDLE_FOR && !s.is_closed())
            .unwrap_or(list.len());
        if stale > 0 {
            list.drain(..stale);
        }
        list.push((sender, now));
    }
}
