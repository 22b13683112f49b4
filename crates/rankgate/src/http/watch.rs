//! The watch over one client connection: its deadlines (the first request's headers within
//! `header_read_timeout`, none in progress for `idle_timeout`, an answer the client takes
//! nothing of for `send_timeout`), the shutdown (finish what is
//! in flight), the end of the drain grace (close now), and a newer connection taking the place
//! of this one ([`super::admission`]): close now if it has not begun a request, else finish
//! gracefully, as at shutdown (HTTP/1 closes when idle, h2 sends GOAWAY).
//!
//! The watch runs as a task of its own beside the connection and tells it what to do through
//! [`Orders`]: the connection's task then costs one atomic load per wake-up. Watching from the
//! connection's own task (a `select!` over the connection, a timer and two signals) polled all
//! four on every wake-up, about 2k instructions per proxied request and 600 per relayed SSE
//! event (bench/instructions.sh).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use super::activity::Activity;
use super::cut::SendCut;
use super::limits::ServeOptions;
use super::shutdown::{shutdown_signalled, Shutdown};

/// A connection future the connection watch can ask to finish gracefully.
pub trait Graceful: Future<Output = Result<(), hyper::Error>> {
    /// Finish what is in flight, take nothing new.
    fn graceful(self: Pin<&mut Self>);
}

const GO_ON: u8 = 0;
const FINISH: u8 = 1;
const CLOSE: u8 = 2;
/// Close now: the client took nothing of its answer for `send_timeout`.
const SEND_CUT: u8 = 3;

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
    // Declared before the connection, so dropped after it: the bodies the connection drops
    // see it armed when the watch cut it for send_timeout.
    let mut cutting = SendCut::default();
    let orders = Arc::new(Orders::default());
    tokio::spawn(watch(
        orders.clone(),
        w.activity.clone(),
        w.opts.clone(),
        w.cut,
        w.shutdown,
    ));
    let conn = std::pin::pin!(conn);
    let watched = Watched {
        conn,
        orders: &orders,
        finishing: false,
        waker: None,
    };
    watched.await;
    orders.ended.notify_one();
    if orders.say.load(Relaxed) == SEND_CUT {
        cutting.arm();
    }
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
            CLOSE | SEND_CUT => return Poll::Ready(()),
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
    let period = (opts.idle_timeout.min(opts.header_read_timeout)).min(opts.send_timeout);
    let mut timer = std::pin::pin!(tokio::time::sleep_until(Instant::now() + period));
    let mut cut = std::pin::pin!(cut.wait_for(|c| *c));
    let ended = orders.ended.notified();
    let mut ended = std::pin::pin!(ended);
    let mut shutting_down = false;
    let mut evicted = false;
    // The client's acknowledged byte count when last seen to move, and since when it has not.
    let mut quiet: Option<(u64, Instant)> = None;
    loop {
        tokio::select! {
            () = &mut ended => return,
            () = &mut timer => {
                let now = Instant::now();
                let quiet_since = client_quiet(&activity, &mut quiet, now);
                let stalled = [activity.stalled_since(), quiet_since].into_iter().flatten().min();
                let stalled = stalled.map(|s| s + opts.send_timeout);
                if stalled.is_some_and(|d| d <= now) {
                    tracing::debug!("client connection cut: it took nothing of its answer for send_timeout");
                    return orders.tell(SEND_CUT);
                }
                // While a request is in progress, a look every twelfth of send_timeout: a
                // client that stops taking its answer is cut at most that much past it.
                let busy = quiet_since.is_some() || activity.active.load(Relaxed) > 0;
                let look = busy.then(|| now + opts.send_timeout / 12);
                match deadline(&activity, &opts).into_iter().chain(stalled).chain(look).min() {
                    Some(d) if d <= now => {
                        tracing::debug!("client connection closed: no request within its timeout");
                        return orders.tell(CLOSE);
                    }
                    Some(d) => timer.as_mut().reset(d.min(now + period)),
                    None => timer.as_mut().reset(now + period),
                }
            }
            _ = &mut cut => return orders.tell(CLOSE),
            () = activity.evicted(), if !evicted => {
                evicted = true;
                if activity.started.load(Relaxed) == 0 {
                    tracing::debug!("client connection closed before its first request: replaced by a newer one");
                    return orders.tell(CLOSE);
                }
                // Idle between requests when chosen; one whose next request began since
                // finishes it first. Never cut: no request in flight is lost for a newcomer.
                tracing::debug!("client connection idle between requests closed gracefully: its place went to a newer one");
                orders.tell(FINISH);
            }
            _ = shutdown_signalled(&mut shutdown), if !shutting_down => {
                shutting_down = true;
                orders.tell(FINISH);
            }
        }
    }
}

/// Since when the client has acknowledged nothing while bytes wait for it (as of this look and
/// the last ones), if so; `last` carries its acknowledged count from look to look.
fn client_quiet(a: &Activity, last: &mut Option<(u64, Instant)>, now: Instant) -> Option<Instant> {
    let Some((acked, true)) = super::progress::look(a.fd.load(Relaxed)) else {
        *last = None;
        return None;
    };
    match last {
        Some((seen, since)) if *seen == acked => Some(*since),
        _ => {
            *last = Some((acked, now));
            Some(now)
        }
    }
}

/// When the connection must close if nothing changes, or `None` while a request is in
/// progress.
fn deadline(a: &Activity, opts: &ServeOptions) -> Option<Instant> {
    if a.active.load(Relaxed) > 0 {
        return None;
    }
    if a.started.load(Relaxed) == 0 {
        return Some(a.opened + opts.header_read_timeout);
    }
    let idle = Duration::from_millis(a.idle_since_ms.load(Relaxed));
    Some(a.opened + idle + opts.idle_timeout)
}
