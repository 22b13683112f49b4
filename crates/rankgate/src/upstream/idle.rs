//! The HTTP/1 connections to one engine that no request is using, kept per core.
//!
//! A request takes the connection its core used last (so the fewest stay warm) straight from
//! the core's own list: one uncontended lock, no hashing of the engine's address and no
//! checkout future, where a general-purpose pool spent about 10k instructions per request
//! (bench/instructions.sh). Once the engine has as many connections open as
//! `server.max_engine_connections` allows, a core with none idle takes another core's rather
//! than open one more. A connection comes back when its response body has ended cleanly, and
//! only then: one left mid-response may never be ready again (a stalled engine). Idle ones go
//! after [`IDLE_FOR`] (a sweep every few seconds, `proxy::sweep_idle_connections`), and all of them with the
//! engine's fleet entry.

use std::sync::Mutex;
use std::time::Duration;

use hyper::client::conn::http1::SendRequest;
use tokio::time::Instant;

use super::request::RequestBody;

/// A request sender on one HTTP/1 connection to an engine.
pub type Sender = SendRequest<RequestBody>;

/// How long a connection may sit unused before it is closed: each holds its buffers, and
/// after a burst of thousands of streams they were most of the memory kept (vLLM's and
/// SGLang's servers close idle keep-alive connections after 5 s anyway).
pub const IDLE_FOR: Duration = Duration::from_secs(15);

/// One engine's idle connections: one list per core (thread-per-core runtimes), each used by
/// its own core (another looks in only when the engine is at its limit), so the locks are
/// hardly ever contended on the request path.
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

    /// The most recently used open connection of `core`'s, if any; with `others`, else one
    /// of another core's.
    pub fn take(&self, core: usize, others: bool) -> Option<Sender> {
        let n = self.lists.len();
        let cores = if others { n } else { 1 };
        (0..cores).find_map(|k| {
            let mut list = self.list(core + k);
            while let Some((sender, _)) = list.pop() {
                if !sender.is_closed() {
                    return Some(sender);
                }
            }
            None
        })
    }

    /// Closes every idle connection: one turned out closed by the engine unannounced, and
    /// those kept beside it are suspect too.
    pub fn clear(&self) {
        for core in 0..self.lists.len() {
            self.list(core).clear();
        }
    }

    /// Closes the connections idle for [`IDLE_FOR`] (and forgets closed ones), on every core.
    pub fn sweep(&self) {
        let now = Instant::now();
        for core in 0..self.lists.len() {
            self.list(core)
                .retain(|(s, since)| now.duration_since(*since) < IDLE_FOR && !s.is_closed());
        }
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use hyper_util::rt::TokioIo;
    use tokio::io::AsyncReadExt;

    use super::{Idle, Sender, IDLE_FOR};
    use crate::upstream::RequestBody;

    /// A client connection to an engine on loopback, and the engine's end: it resolves to what
    /// one read got (0 once the connection is closed).
    async fn connection() -> (Sender, tokio::task::JoinHandle<usize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let engine = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 16];
            s.read(&mut buf).await.unwrap()
        });
        let io = TokioIo::new(tokio::net::TcpStream::connect(addr).await.unwrap());
        let (sender, conn) = hyper::client::conn::http1::handshake::<_, RequestBody>(io)
            .await
            .unwrap();
        tokio::spawn(conn);
        (sender, engine)
    }

    /// A connection given back stays for the next request, and is closed (the engine sees it
    /// end) once it has waited [`IDLE_FOR`] and a sweep comes by.
    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_is_kept_then_closed_by_the_sweep() {
        let (sender, engine) = connection().await;
        let idle = Idle::new(2);
        idle.give_back(1, sender);
        tokio::time::advance(IDLE_FOR - Duration::from_secs(1)).await;
        idle.sweep();
        let sender = idle
            .take(1, false)
            .expect("kept while younger than IDLE_FOR");
        assert!(idle.take(1, false).is_none() && idle.take(0, true).is_none());
        idle.give_back(1, sender);
        assert!(idle.take(0, false).is_none(), "core 0 has none of its own");
        tokio::time::advance(IDLE_FOR + Duration::from_secs(1)).await;
        idle.sweep();
        assert!(idle.take(0, true).is_none(), "swept");
        let read = tokio::time::timeout(Duration::from_secs(5), engine).await;
        assert_eq!(
            read.unwrap().unwrap(),
            0,
            "the engine saw the connection close"
        );
    }

    /// A core with none of its own takes another core's when asked to.
    #[tokio::test]
    async fn a_core_may_take_another_cores_connection() {
        let (sender, _engine) = connection().await;
        let idle = Idle::new(3);
        idle.give_back(2, sender);
        assert!(idle.take(0, false).is_none());
        assert!(idle.take(0, true).is_some());
    }
}
