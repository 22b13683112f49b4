//! Who may hold a listener's client connections. One client address holds at most
//! `max_connections_per_client` of them and the listeners of a door at most `max_connections`
//! together; when either is full, a newcomer takes the place of the OLDEST connection in that
//! scope that has not yet sent a complete request (its TLS handshake, h2 preface or first head
//! still to come). Only when every connection there is serving does the newcomer wait: for a
//! place of its address (given back by one of its connections) until its header deadline, in a
//! queue of at most `max_connections_per_client` whose oldest a newcomer replaces beyond that;
//! or, the door being full, in the kernel's backlog (accepting pauses, as before). Waiting
//! rather than refusing at once matters for a client that closes and reopens connections at its
//! limit: the close has not been seen yet when the new one arrives.
//!
//! Why replace rather than refuse: a flood of idle sockets from one address then churns through
//! its own share and nobody else's, while a real client behind the same address (a probe, a
//! NATed user) still gets in, since its connection is the newest and sends its request at once.
//! The door-wide replacement is what keeps the admin listener's probes answering with its table
//! full of idle sockets from many addresses, and the front door serving new clients with its
//! table full of half-open TLS handshakes.
//!
//! The tables sit behind one std mutex taken three times per connection (admitted, given its
//! slot, closed) and never per request: a connection's requests only bump its [`Activity`]'s
//! atomics. Connections that served or closed stay in the queues until met at their head, or
//! swept when a queue grows past twice what it can hold, so a queue is bounded by its table.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::activity::Activity;

/// How long a new connection has to send its first request before a newer one may take its
/// place. Accepted is not yet read: without it, a connection whose request was on its way (or
/// whose TLS handshake was a round trip from done) was closed for a newcomer no more real than
/// it. A flood of idle sockets is replaceable after this; until then, the newcomers of a full
/// address queue for a place (or are refused, the queue full), and a full door pauses. It also
/// sets how fast a full door turns over (its size per this much time), so it stays short: a
/// couple of round trips on a long path.
pub(super) const REPLACEABLE_AFTER: Duration = Duration::from_millis(250);

/// The client address limit and the queues of connections not serving yet.
#[derive(Debug)]
pub(super) struct Admission {
    pub(super) per_client: usize,
    max_connections: usize,
    tables: Mutex<Tables>,
    /// Connections closed at their header deadline while waiting for a place: their address
    /// held its limit, all of it serving.
    pub(super) refused: AtomicU64,
    /// Connections closed before their first request to make room for a newer one.
    pub(super) replaced: AtomicU64,
}

#[derive(Debug, Default)]
struct Tables {
    clients: HashMap<IpAddr, Client>,
    /// Connections admitted and not ended yet.
    live: usize,
    /// Every connection of the door holding a slot and not serving yet, oldest first. Only
    /// once it holds a slot ([`Admission::holds_slot`]): closing a connection still waiting
    /// for one (in another listener's accept loop, with thread-per-core) gave no slot back, and
    /// a full door whose every accept loop then waited for a slot stalled until a header
    /// deadline.
    waiting: VecDeque<Weak<Activity>>,
}

#[derive(Debug, Default)]
struct Client {
    /// Places taken.
    open: usize,
    /// The address's connections holding a place and not serving yet, oldest first.
    waiting: VecDeque<Weak<Activity>>,
    /// Connections waiting for a place, and their queue, oldest first.
    queued: usize,
    queue: VecDeque<Weak<Activity>>,
    /// Told when a place is given back.
    freed: Arc<Notify>,
}

/// A connection's place in its address's count, given back when the connection ends (unless a
/// newer connection of the address took it over).
pub(super) struct Ticket {
    admission: Arc<Admission>,
    ip: IpAddr,
    activity: Arc<Activity>,
}

impl Admission {
    pub(super) fn new(max_connections: usize, per_client: usize) -> Admission {
        Admission {
            per_client: per_client.clamp(1, max_connections.max(1)),
            max_connections,
            tables: Mutex::new(Tables::default()),
            refused: AtomicU64::new(0),
            replaced: AtomicU64::new(0),
        }
    }

    fn tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a new connection from `ip` against its address: a place of its own, or the place
    /// of the address's oldest connection with no request yet. With every place serving, the
    /// connection must wait for one ([`Place::Wait`]), in a queue of at most
    /// `max_connections_per_client`, whose oldest a newcomer replaces beyond that.
    pub(super) fn admit(&self, ip: IpAddr, activity: &Arc<Activity>) -> Place {
        let mut t = self.tables();
        let per_client = self.per_client;
        let client = t.clients.entry(ip).or_default();
        let place = if client.open < per_client {
            client.open += 1;
            Place::Now
        } else if let Some(oldest) = pop_waiting(&mut client.waiting) {
            // Its place goes to the newcomer: the count stays as it is.
            oldest.evict(true);
            self.replaced.fetch_add(1, Relaxed);
            Place::Now
        } else if client.queued < per_client {
            client.queued += 1;
            push(&mut client.queue, activity, per_client);
            Place::Wait(client.freed.clone())
        } else if let Some(oldest) = pop_queued(&mut client.queue) {
            // Its spot in the queue goes to the newcomer (the count stays as it is: the one
            // replaced gives its spot back when it ends, which its ticket then skips).
            oldest.evict(true);
            self.replaced.fetch_add(1, Relaxed);
            push(&mut client.queue, activity, per_client);
            Place::Wait(client.freed.clone())
        } else {
            self.refused.fetch_add(1, Relaxed);
            return Place::Refused;
        };
        if let Place::Now = place {
            activity.placed();
            push(&mut client.waiting, activity, per_client);
        }
        t.live += 1;
        place
    }

    /// `activity`'s connection holds one of the door's slots now: a full door may close it for
    /// a newer one (never before, see [`Tables::waiting`]).
    pub(super) fn holds_slot(&self, activity: &Arc<Activity>) {
        let mut t = self.tables();
        push(&mut t.waiting, activity, self.max_connections);
    }

    /// A place for `activity`, queued at its address, if one is free now.
    pub(super) fn take_place(&self, ip: IpAddr, activity: &Arc<Activity>) -> bool {
        let mut t = self.tables();
        let per_client = self.per_client;
        let Some(client) = t.clients.get_mut(&ip) else {
            return false;
        };
        if client.open >= per_client || activity.is_placed() || !activity.waiting() {
            return false;
        }
        client.open += 1;
        client.queued = client.queued.saturating_sub(1);
        activity.placed();
        push(&mut client.waiting, activity, per_client);
        true
    }

    /// The door is full: closes its oldest connection not serving yet, if it has had its
    /// [`REPLACEABLE_AFTER`].
    pub(super) fn replace_oldest(&self) -> Replace {
        let mut t = self.tables();
        if let Some(oldest) = pop_waiting(&mut t.waiting) {
            oldest.evict(false);
            self.replaced.fetch_add(1, Relaxed);
            return Replace::Done;
        }
        // pop_waiting left the front alone only if it is waiting and too young.
        match t.waiting.front().and_then(Weak::upgrade) {
            Some(a) => Replace::Later(a.opened + REPLACEABLE_AFTER),
            None => Replace::AllServing,
        }
    }

    fn release(&self, ip: IpAddr, activity: &Activity) {
        let mut t = self.tables();
        t.live = t.live.saturating_sub(1);
        // After a flood the queue would otherwise keep what it held (each entry keeps its
        // connection's small record allocated) until the next one.
        if t.waiting.len() > 2 * t.live + 64 {
            t.waiting.retain(is_waiting);
        }
        let Some(c) = t.clients.get_mut(&ip) else {
            return;
        };
        // Read under the lock that `admit` and `take_place` set them under.
        match (activity.is_placed(), activity.handed_over()) {
            (true, true) => {}
            (true, false) => {
                c.open = c.open.saturating_sub(1);
                c.freed.notify_one();
            }
            (false, true) => {}
            (false, false) => c.queued = c.queued.saturating_sub(1),
        }
        // Kept while a connection waits on its `freed`.
        if c.open == 0 && c.queued == 0 {
            t.clients.remove(&ip);
        }
    }

    /// Client addresses holding connections now.
    pub(super) fn clients(&self) -> usize {
        self.tables().clients.len()
    }
}

/// What a full door could do.
#[derive(Debug, Clone, Copy)]
pub(super) enum Replace {
    /// Its oldest connection with no request yet was told to close.
    Done,
    /// Its oldest connection with no request yet may be replaced at this instant.
    Later(Instant),
    /// Every connection is serving.
    AllServing,
}

/// Where a new connection stands with its address.
pub(super) enum Place {
    /// It holds a place: serve it.
    Now,
    /// Every place is serving: wait until `freed` says one was given back, then
    /// [`Admission::take_place`].
    Wait(Arc<Notify>),
    /// Every place serving, the queue full of connections too young to replace: close it.
    Refused,
}

impl Ticket {
    pub(super) fn new(admission: &Arc<Admission>, ip: IpAddr, a: &Arc<Activity>) -> Ticket {
        Ticket {
            admission: admission.clone(),
            ip,
            activity: a.clone(),
        }
    }

    /// Waits for a place at the connection's address (given back by one of its connections),
    /// until `deadline`. `false`: none came in time, or a newer connection replaced this one.
    pub(super) async fn wait_for_place(&self, freed: &Notify, deadline: Instant) -> bool {
        let (admission, ip, activity) = (&self.admission, self.ip, &self.activity);
        let waited = tokio::time::timeout_at(deadline, async {
            loop {
                if admission.take_place(ip, activity) {
                    return true;
                }
                tokio::select! {
                    () = freed.notified() => {}
                    () = activity.evicted() => return false,
                }
            }
        })
        .await;
        if waited.is_err() {
            admission.refused.fetch_add(1, Relaxed);
        }
        waited.unwrap_or(false)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.admission.release(self.ip, &self.activity);
    }
}

/// Queues `a`, sweeping out connections that served or closed when the queue grows past twice
/// what it can hold.
fn push(queue: &mut VecDeque<Weak<Activity>>, a: &Arc<Activity>, holds: usize) {
    queue.push_back(Arc::downgrade(a));
    if queue.len() > 2 * holds + 64 {
        queue.retain(is_waiting);
    }
}

fn is_waiting(w: &Weak<Activity>) -> bool {
    w.upgrade().is_some_and(|a| a.waiting())
}

/// The oldest connection of `queue` still waiting for its first request, if it has had
/// [`REPLACEABLE_AFTER`] to send it.
fn pop_waiting(queue: &mut VecDeque<Weak<Activity>>) -> Option<Arc<Activity>> {
    pop_oldest(queue, |_| true)
}

/// [`pop_waiting`] for an address's queue, skipping the connections that took a place since
/// they queued ([`Admission::take_place`] leaves them there). Replacing one of those as if it
/// were queued handed its place to a newcomer that only queued: the place was never given
/// back, and after enough of them the address's every place was held by nobody, its
/// connections all waiting for a place until their header deadline.
fn pop_queued(queue: &mut VecDeque<Weak<Activity>>) -> Option<Arc<Activity>> {
    pop_oldest(queue, |a| !a.is_placed())
}

fn pop_oldest(
    queue: &mut VecDeque<Weak<Activity>>,
    keep: impl Fn(&Activity) -> bool,
) -> Option<Arc<Activity>> {
    while let Some(w) = queue.front() {
        match w.upgrade().filter(|a| a.waiting() && keep(a)) {
            // The queue is oldest first: if this one is too young, so are all after it.
            Some(a) if a.opened.elapsed() < REPLACEABLE_AFTER => return None,
            Some(a) => {
                queue.pop_front();
                return Some(a);
            }
            None => {
                queue.pop_front();
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    /// A connection the door has not given a slot yet (it waits in an accept loop, one of
    /// several with thread-per-core) is never the one a full door closes: closing it frees no
    /// slot, and the accept loops all waited for one that never came.
    #[tokio::test(start_paused = true)]
    async fn a_full_door_closes_only_connections_holding_a_slot() {
        let adm = Admission::new(2, 2);
        let (a, b) = (Arc::new(Activity::new()), Arc::new(Activity::new()));
        assert!(matches!(adm.admit(ip(2), &a), Place::Now));
        assert!(matches!(adm.admit(ip(3), &b), Place::Now));
        adm.holds_slot(&b);
        tokio::time::advance(REPLACEABLE_AFTER).await;
        // `a`, older, still waits for its slot: `b` goes.
        assert!(matches!(adm.replace_oldest(), Replace::Done));
        assert!(a.waiting() && !b.waiting());
        // Nothing else holds a slot.
        assert!(matches!(adm.replace_oldest(), Replace::AllServing));
        assert!(a.waiting());
    }

    /// A queued connection that took a place has left the queue: a newcomer replacing the
    /// queue's oldest passes it over. Replaced as if queued, it handed its place to a newcomer
    /// that only queued, and the place was never given back.
    #[tokio::test(start_paused = true)]
    async fn a_connection_that_took_a_place_is_not_replaced_as_queued() {
        let adm = Arc::new(Admission::new(16, 2));
        let mut tickets = Vec::new();
        let conn = |tickets: &mut Vec<Ticket>, expect: fn(&Place) -> bool| {
            let a = Arc::new(Activity::new());
            let place = adm.admit(ip(2), &a);
            assert!(expect(&place));
            if !matches!(place, Place::Refused) {
                tickets.push(Ticket::new(&adm, ip(2), &a));
            }
            a
        };
        let now = |p: &Place| matches!(p, Place::Now);
        let wait = |p: &Place| matches!(p, Place::Wait(_));
        let (b1, b2) = (conn(&mut tickets, now), conn(&mut tickets, now));
        let (g1, g2) = (b1.begin(), b2.begin());
        let q1 = conn(&mut tickets, wait);
        tokio::time::advance(REPLACEABLE_AFTER * 2).await;
        // b1 ends: a newcomer takes its place before q1 looks.
        drop(g1);
        drop(tickets.remove(0));
        let x = conn(&mut tickets, now);
        // b2 ends: q1 takes its place.
        drop(g2);
        drop(tickets.remove(0));
        assert!(adm.take_place(ip(2), &q1));
        // Two newcomers queue (x is too young to replace), a third finds the queue full of
        // young ones and q1, which is no longer queued.
        let (n1, n2) = (conn(&mut tickets, wait), conn(&mut tickets, wait));
        let _n3 = conn(&mut tickets, |p| matches!(p, Place::Refused));
        assert!(q1.waiting() && n1.waiting() && n2.waiting() && x.waiting());
        drop(tickets);
        // Every place given back: the address holds none.
        assert_eq!(adm.clients(), 0);
    }
}
