//! What is known of one client connection, kept current by its requests: when it opened, its
//! requests started and in progress, when it last went idle, and whether a newer connection
//! took its place. Read by the connection watch (its deadlines), the admission tables (which
//! connections may be replaced: not serving yet, or idle between requests) and the
//! connection's bytes (its 431s).

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use tokio::sync::Notify;
use tokio::time::Instant;

/// What the watch knows of one client connection, kept current by its requests.
pub(super) struct Activity {
    pub(super) opened: Instant,
    /// Requests whose response has not ended yet.
    pub(super) active: AtomicUsize,
    /// Requests ever started on the connection.
    pub(super) started: AtomicU64,
    /// Milliseconds after `opened` when the connection last went idle.
    pub(super) idle_since_ms: AtomicU64,
    /// Milliseconds after `opened`, plus one, when a write to the client last found its socket
    /// full with nothing taken since; 0 while writes go through. Kept by [`super::conn::ClientIo`],
    /// read by the watch for `send_timeout`.
    pub(super) write_stalled_ms: AtomicU64,
    /// The client's TCP socket, for the watch to ask whether the client takes what is sent
    /// ([`super::progress`]); -1: none.
    pub(super) fd: AtomicI32,
    /// Responses with status 431 the service has given (an engine's, or rankgate's own): the
    /// 431s on the wire that are not hyper's refusal of a head (see [`super::conn::ClientIo`]).
    pub(super) answered_431: AtomicUsize,
    /// Closed to make room for a newer connection (see [`super::admission`]): at once before
    /// its first request, gracefully after; told through `evict`, which keeps the word until
    /// the connection's task looks (a stored permit).
    evicted: AtomicBool,
    evict: Notify,
    /// It holds a place in its address's count (else it waits for one).
    placed: AtomicBool,
    /// Its place in its address's count went to the connection that replaced it.
    handed_over: AtomicBool,
    /// The client has sent bytes (set once, before its first request).
    spoke: AtomicBool,
}

impl Activity {
    pub(super) fn new() -> Activity {
        Activity {
            opened: Instant::now(),
            active: AtomicUsize::new(0),
            started: AtomicU64::new(0),
            idle_since_ms: AtomicU64::new(0),
            write_stalled_ms: AtomicU64::new(0),
            fd: AtomicI32::new(-1),
            answered_431: AtomicUsize::new(0),
            evicted: AtomicBool::new(false),
            evict: Notify::new(),
            placed: AtomicBool::new(false),
            handed_over: AtomicBool::new(false),
            spoke: AtomicBool::new(false),
        }
    }

    /// No request yet, and not told to close: a connection a newer one may replace.
    pub(super) fn waiting(&self) -> bool {
        self.started.load(Relaxed) == 0 && !self.evicted.load(Relaxed)
    }

    /// Told to close for a newer connection.
    pub(super) fn told_to_close(&self) -> bool {
        self.evicted.load(Relaxed)
    }

    /// When the connection went idle, if it is idle between requests now (it served one, has
    /// none in progress, and was not told to close).
    pub(super) fn idle_since(&self) -> Option<Instant> {
        if self.started.load(Relaxed) == 0
            || self.active.load(Relaxed) > 0
            || self.evicted.load(Relaxed)
        {
            return None;
        }
        Some(self.opened + std::time::Duration::from_millis(self.idle_since_ms.load(Relaxed)))
    }

    /// Tells the connection to close (at once if no request began yet, else once what is in
    /// progress is done: see [`super::watch`]); `hand_over`: its place in its address's count
    /// goes to the newcomer.
    pub(super) fn evict(&self, hand_over: bool) {
        self.handed_over.store(hand_over, Relaxed);
        self.evicted.store(true, Relaxed);
        self.evict.notify_one();
    }

    /// The connection has ended: never one to close for a newer one (its record may outlive
    /// it a moment in the tables' queues).
    pub(super) fn ended(&self) {
        self.evicted.store(true, Relaxed);
    }

    /// The client has sent its first bytes.
    pub(super) fn spoke(&self) {
        self.spoke.store(true, Relaxed);
    }

    pub(super) fn has_spoken(&self) -> bool {
        self.spoke.load(Relaxed)
    }

    pub(super) fn placed(&self) {
        self.placed.store(true, Relaxed);
    }

    pub(super) fn is_placed(&self) -> bool {
        self.placed.load(Relaxed)
    }

    pub(super) fn handed_over(&self) -> bool {
        self.handed_over.load(Relaxed)
    }

    /// Resolves once the connection is told to close for a newer one. Whether to close at once
    /// (no request yet) or gracefully is the watch's to say ([`super::watch`]).
    pub(super) async fn evicted(&self) {
        self.evict.notified().await;
    }

    /// What a write to the client came to: a socket found full starts the stall's clock (if
    /// not running), any byte taken stops it. One load per write while the client keeps up.
    #[inline]
    pub(super) fn wrote<T>(
        &self,
        r: &std::task::Poll<std::io::Result<T>>,
        took: impl Fn(&T) -> bool,
    ) {
        match r {
            std::task::Poll::Pending => {
                if self.write_stalled_ms.load(Relaxed) == 0 {
                    let at = self.opened.elapsed().as_millis() as u64 + 1;
                    self.write_stalled_ms.store(at, Relaxed);
                }
            }
            std::task::Poll::Ready(Ok(n)) if took(n) => {
                if self.write_stalled_ms.load(Relaxed) != 0 {
                    self.write_stalled_ms.store(0, Relaxed);
                }
            }
            std::task::Poll::Ready(_) => {}
        }
    }

    /// Since when the client has taken nothing of what waits to be written to it, if so.
    pub(super) fn stalled_since(&self) -> Option<Instant> {
        match self.write_stalled_ms.load(Relaxed) {
            0 => None,
            at => Some(self.opened + std::time::Duration::from_millis(at - 1)),
        }
    }

    /// A request has begun; it stays active until the guard is dropped (with its response body).
    pub(super) fn begin(self: &Arc<Activity>) -> ActiveGuard {
        self.started.fetch_add(1, Relaxed);
        self.active.fetch_add(1, Relaxed);
        ActiveGuard(self.clone())
    }
}

/// Counts a request as active on its connection until its response body ends.
pub(super) struct ActiveGuard(Arc<Activity>);

impl ActiveGuard {
    /// The service's answer to this request has status 431.
    pub(super) fn answered_431(&self) {
        self.0.answered_431.fetch_add(1, Relaxed);
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        let a = &self.0;
        a.idle_since_ms
            .store(a.opened.elapsed().as_millis() as u64, Relaxed);
        a.active.fetch_sub(1, Relaxed);
    }
}
