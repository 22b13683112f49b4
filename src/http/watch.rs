//! The watch over one client connection: its deadlines (the first request's headers within
//! `header_read_timeout`, none in progress for `idle_timeout`), the shutdown (finish what is
//! in flight) and the end of the drain grace (close now).
//!
//! The watch runs as a task of its own beside the connection and tells it what to do through
//! [`Orders`]: the connection's task then costs one atomic load per wake-up. Watching from the
//! connection's own task (a `select!` over the connection, a timer and two signals) polled all
//! four on every wake-up, about 2k instructions per proxied request and 600 per relayed SSE
//! event (bench/instructions.sh).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use super::limits::ServeOptions;
use super::shutdown::{shutdown_signalled, Shutdown};

/// A connection future the connection watch can ask to finish gracefully.
pub trait Graceful: Future<Output = Result<(), hyper::Error>> {
    /// Finish what is in flight, take nothing new.
    fn graceful(self: Pin<&mut Self>);
}

/// What the watch knows of one client connection, kept current by its requests.
pub(super) struct Activity {
    pub(super) opened: Instant,
    /// Requests whose response has not ended yet.
    pub(super) active: AtomicUsize,
    /// Requests ever started on the connection.
    pub(super) started: AtomicU64,
    /// Milliseconds after `opened` when the connection last went idle.
    idle_since_ms: AtomicU64,
    /// Responses with status 431 the service has given (an engine's, or rankgate's own): the
    /// 431s on the wire that are not hyper's refusal of a head (see [`super::conn::ClientIo`]).
    pub(super) answered_431: AtomicUsize,
    /// Closed to make room for a newer connection (see [`super::admission`]); told through
    /// `evict`, which keeps the word until the connection's task looks (a stored permit).
    evicted: AtomicBool,
    evict: Notify,
    /// Its place in its address's count went to the connection that replaced it.
    handed_over: AtomicBool,
}

impl Activity {
    pub(super) fn new() -> Activity {
        Activity {
            opened: Instant::now(),
            active: AtomicUsize::new(0),
            started: AtomicU64::new(0),
            idle_since_ms: AtomicU64::new(0),
            answered_431: AtomicUsize::new(0),
            evicted: AtomicBool::new(false),
            evict: Notify::new(),
            handed_over: AtomicBool::new(false),
        }
    }

    /// No request yet, and not told to close: a connection a newer one may replace.
    pub(super) fn waiting(&self) -> bool {
        self.started.load(Relaxed) == 0 && !self.evicted.load(Relaxed)
    }

    /// Tells the connection to close (it does unless a request began meanwhile); `hand_over`:
    /// its place in its address's count goes to the newcomer.
    pub(super) fn evict(&self, hand_over: bool) {
        self.handed_over.store(hand_over, Relaxed);
        self.evicted.store(true, Relaxed);
        self.evict.notify_one();
    }

    pub(super) fn handed_over(&self) -> bool {
        self.handed_over.load(Relaxed)
    }

    /// Resolves once the connection is told to close for a newer one while it has served no
    /// request (an eviction that came after its first request began is let go).
    pub(super) async fn evicted(&self) {
        loop {
            self.evict.notified().await;
            if self.started.load(Relaxed) == 0 {
                return;
            }
        }
    }

    /// A request has begun; it stays active until the guard is dropped (with its response body).
    pub(super) fn begin(self: &Arc<Activity>) -> ActiveGuard {
        self.started.fetch_add(1, Relaxed);
        self.active.fetch_add(1, Relaxed);
        ActiveGuard(self.clone())
    }

    /// When the connection must close if nothing changes, or `None` while a request is in
    /// progress.
    fn deadline(&self, opts: &ServeOptions) -> Option<Instant> {
        if self.active.load(Relaxed) > 0 {
            return None;
        }
        if self.started.load(Relaxed) == 0 {
            return Some(self.opened + opts.header_read_timeout);
        }
        let idle = Duration::from_millis(self.idle_since_ms.load(Relaxed));
        Some(self.opened + idle + opts.idle_timeout)
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

const GO_ON: u8 = 0;
const FINISH: u8 = 1;
const CLOSE: u8 = 2;

/// What the watch tells its connection, and how each side wakes the other.
#[derive(Default)]
struct Orders {
    say: AtomicU8,
    /// The connection's task, told when the order changes.
    conn: Mutex<Option<Waker>>,
    /// Told by the connection when it ends, so the watch ends with it.
    ended: Notify,
}

impl Orders {
    fn tell(&self, order: u8) {
        self.say.fetch_max(order, Relaxed);
        let waker = self.conn.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// Where one connection is watched from: the settings and the two process-wide signals.
pub(super) struct Watch<'a> {
    pub(super) activity: &'a Arc<Activity>,
    pub(super) opts: &'a ServeOptions,
    pub(super) cut: watch::Receiver<bool>,
    pub(super) shutdown: Shutdown,
}

/// Serves `conn` until it ends, its deadlines pass, or the drain grace expires; at shutdown it
/// finishes what is in flight and takes nothing new.
pub(super) async fn drive<C: Graceful>(conn: C, w: Watch<'_>) {
    let orders = Arc::new(Orders::default());
    tokio::spawn(watch(
        orders.clone(),
        w.activity.clone(),
        w.opts.clone(),
        w.cut,
        w.shutdown,
    ));
    let watched = Watched {
        conn: std::pin::pin!(conn),
        orders: &orders,
        finishing: false,
        waker: None,
    };
    watched.await;
    orders.ended.notify_one();
}

/// The connection as its task polls it: first what the watch says (one load), then hyper.
struct Watched<'a, C> {
    conn: Pin<&'a mut C>,
    orders: &'a Orders,
    finishing: bool,
    /// The waker last given to the watch: given again only when the task's changes.
    waker: Option<Waker>,
}

impl<C: Graceful> Future for Watched<'_, C> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        match this.orders.say.load(Relaxed) {
            // The drain grace expired (or the accept loop is gone): dropping the connection
            // closes it, streams and all.
            CLOSE => return Poll::Ready(()),
            FINISH if !this.finishing => {
                this.finishing = true;
                this.conn.as_mut().graceful();
            }
            _ => {}
        }
        if !this.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            let w = cx.waker().clone();
            *this.orders.conn.lock().unwrap_or_else(|p| p.into_inner()) = Some(w.clone());
            this.waker = Some(w);
            // An order given before the waker was there would be missed: look again.
            match this.orders.say.load(Relaxed) {
                GO_ON => {}
                FINISH if this.finishing => {}
                _ => cx.waker().wake_by_ref(),
            }
        }
        match this.conn.as_mut().poll(cx) {
            Poll::Ready(r) => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with error");
                }
                Poll::Ready(())
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The watch's task: looks at the connection at least once a period, never once per
/// request. A deadline is re-armed exactly when a look finds the connection idle, and since a
/// period is no longer than `idle_timeout`, the look after a request ends always comes before
/// that request's idle deadline.
async fn watch(
    orders: Arc<Orders>,
    activity: Arc<Activity>,
    opts: ServeOptions,
    mut cut: watch::Receiver<bool>,
    mut shutdown: Shutdown,
) {
    let period = opts.idle_timeout.min(opts.header_read_timeout);
    let mut timer = std::pin::pin!(tokio::time::sleep_until(Instant::now() + period));
    let mut cut = std::pin::pin!(cut.wait_for(|c| *c));
    let ended = orders.ended.notified();
    let mut ended = std::pin::pin!(ended);
    let mut shutting_down = false;
    loop {
        tokio::select! {
            () = &mut ended => return,
            () = &mut timer => {
                let now = Instant::now();
                match activity.deadline(&opts) {
                    Some(d) if d <= now => {
                        tracing::debug!("client connection closed: no request within its timeout");
                        return orders.tell(CLOSE);
                    }
                    Some(d) => timer.as_mut().reset(d.min(now + period)),
                    None => timer.as_mut().reset(now + period),
                }
            }
            _ = &mut cut => return orders.tell(CLOSE),
            () = activity.evicted(), if activity.started.load(Relaxed) == 0 => {
                tracing::debug!("client connection closed before its first request: replaced by a newer one");
                return orders.tell(CLOSE);
            }
            _ = shutdown_signalled(&mut shutdown), if !shutting_down => {
                shutting_down = true;
                orders.tell(FINISH);
            }
        }
    }
}
