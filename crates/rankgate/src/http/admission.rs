//! Who may hold a listener's client connections. Connection places are for work. One client
//! (an IPv4 address, an IPv6 prefix: [`super::client_key`]) holds at most
//! `max_connections_per_client` of them and the listeners of a door at most `max_connections`
//! together; when either is full, a newcomer takes the place of, in this order:
//! - the OLDEST connection in that scope that has not yet sent a complete request (its TLS
//!   handshake, h2 preface or first head still to come), once it has had [`REPLACEABLE_AFTER`];
//!   it is closed at once;
//! - else the connection in that scope idle BETWEEN requests for the longest (no request in
//!   progress, its last response sent), from the address holding the most places when the
//!   scope is the door (nginx's "reusable" connections). It is closed gracefully: an HTTP/1
//!   connection only while idle (one whose next request has begun finishes it, then closes), an
//!   h2 one with GOAWAY (its streams finish). No request in flight is ever cut for a newcomer.
//!
//! Without the second, eight addresses whose sockets each sent one cheap request and then
//! idled held the admin listener (and the front door) until `idle_timeout`.
//!
//! Only when every connection there is serving does the newcomer wait: for a
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
//! atomics, and whether a connection is idle is read from them when a place is needed (a scan
//! of the address's connections, only when its scope is full). Connections that served or
//! closed stay in the queues until met at their head, or swept when a queue grows past twice
//! what it can hold, so a queue is bounded by its table.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::activity::Activity;
use super::client_key::client_key;

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
    /// `server.client_ipv6_prefix`.
    ipv6_prefix: u8,
    tables: Mutex<Tables>,
    /// Connections closed at their header deadline while waiting for a place: their address
    /// held its limit, all of it serving.
    pub(super) refused: AtomicU64,
    /// Connections closed before their first request to make room for a newer one.
    pub(super) replaced: AtomicU64,
    /// Connections idle between requests closed to make room for a newer one.
    pub(super) reclaimed: AtomicU64,
}

#[derive(Debug, Default)]
struct Tables {
    clients: HashMap<IpAddr, Client>,
    /// The clients holding places, by how many: a full door reclaims from the largest first.
    by_open: BTreeSet<(usize, IpAddr)>,
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
    /// Every connection of the address holding a place, oldest first: where the idle ones are
    /// looked for.
    placed: VecDeque<Weak<Activity>>,
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
    pub(super) fn new(max_connections: usize, per_client: usize, ipv6_prefix: u8) -> Admission {
        Admission {
            per_client: per_client.clamp(1, max_connections.max(1)),
            max_connections,
            ipv6_prefix,
            tables: Mutex::new(Tables::default()),
            refused: AtomicU64::new(0),
            replaced: AtomicU64::new(0),
            reclaimed: AtomicU64::new(0),
        }
    }

    /// What a connection from `ip` counts against ([`client_key`]).
    pub(super) fn key(&self, ip: IpAddr) -> IpAddr {
        client_key(ip, self.ipv6_prefix)
    }

    fn tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts a new connection from `ip` (a [`Admission::key`]) against its address: a place
    /// of its own, or the place of the address's oldest connection with no request yet, else
    /// of its longest idle one. With every place serving, the connection must wait for one
    /// ([`Place::Wait`]), in a queue of at most `max_connections_per_client`, whose oldest a
    /// newcomer replaces beyond that.
    pub(super) fn admit(&self, ip: IpAddr, activity: &Arc<Activity>) -> Place {
        let mut t = self.tables();
        let per_client = self.per_client;
        let Tables {
            clients, by_open, ..
        } = &mut *t;
        let client = clients.entry(ip).or_default();
        let place = if client.open < per_client {
            set_open(by_open, ip, client, client.open + 1);
            Place::Now
        } else if let Some(oldest) = pop_waiting(&mut client.waiting) {
            // Its place goes to the newcomer: the count stays as it is.
            oldest.evict(true);
            self.replaced.fetch_add(1, Relaxed);
            Place::Now
        } else if let Some(idle) = pop_idle(&mut client.placed) {
            // The same, closed gracefully.
            idle.evict(true);
            self.reclaimed.fetch_add(1, Relaxed);
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
            push_placed(&mut client.placed, activity, per_client);
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
        let Tables {
            clients, by_open, ..
        } = &mut *t;
        let Some(client) = clients.get_mut(&ip) else {
            return false;
        };
        if client.open >= per_client || activity.is_placed() || !activity.waiting() {
            return false;
        }
        set_open(by_open, ip, client, client.open + 1);
        client.queued = client.queued.saturating_sub(1);
        activity.placed();
        push(&mut client.waiting, activity, per_client);
        push_placed(&mut client.placed, activity, per_client);
        true
    }

    /// `activity`, queued at its address, has sent its first bytes: it takes the place of the
    /// address's oldest connection holding one that has sent nothing yet, of any age (that one
    /// is closed). A client behind a flooder's address (a NAT) then gets in however fast the
    /// flood's silent sockets come, while a flood that speaks only trades places with itself.
    pub(super) fn take_over(&self, ip: IpAddr, activity: &Arc<Activity>) -> bool {
        let mut t = self.tables();
        let per_client = self.per_client;
        let Some(client) = t.clients.get_mut(&ip) else {
            return false;
        };
        if activity.is_placed() || !activity.waiting() {
            return false;
        }
        let silent = (client.waiting.iter().enumerate()).find_map(|(i, w)| {
            Some((i, w.upgrade()?)).filter(|(_, a)| a.waiting() && !a.has_spoken())
        });
        let Some((i, silent)) = silent else {
            return false;
        };
        client.waiting.remove(i);
        silent.evict(true);
        self.replaced.fetch_add(1, Relaxed);
        client.queued = client.queued.saturating_sub(1);
        activity.placed();
        push(&mut client.waiting, activity, per_client);
        push_placed(&mut client.placed, activity, per_client);
        true
    }

    /// The door is full: closes its oldest connection not serving yet, if it has had its
    /// [`REPLACEABLE_AFTER`], else its longest idle connection of the client holding the most
    /// (gracefully).
    pub(super) fn replace_oldest(&self) -> Replace {
        let mut t = self.tables();
        if let Some(oldest) = pop_waiting(&mut t.waiting) {
            oldest.evict(false);
            self.replaced.fetch_add(1, Relaxed);
            return Replace::Done;
        }
        let Tables {
            clients, by_open, ..
        } = &mut *t;
        // Largest first; a client whose every connection is busy is passed over.
        let idle =
            (by_open.iter().rev()).find_map(|(_, ip)| pop_idle(&mut clients.get_mut(ip)?.placed));
        if let Some(idle) = idle {
            idle.evict(false);
            self.reclaimed.fetch_add(1, Relaxed);
            return Replace::Done;
        }
        // pop_waiting left the front alone only if it is waiting and too young.
        match t.waiting.front().and_then(Weak::upgrade) {
            Some(a) => Replace::Later(a.opened + REPLACEABLE_AFTER),
            None => Replace::AllServing,
        }
    }

    fn release(&self, ip: IpAddr, activity: &Activity) {
        activity.ended();
        let mut t = self.tables();
        t.live = t.live.saturating_sub(1);
        // After a flood the queue would otherwise keep what it held (each entry keeps its
        // connection's small record allocated) until the next one.
        if t.waiting.len() > 2 * t.live + 64 {
            t.waiting.retain(is_waiting);
        }
        let Tables {
            clients, by_open, ..
        } = &mut *t;
        let Some(c) = clients.get_mut(&ip) else {
            return;
        };
        // Read under the lock that `admit` and `take_place` set them under.
        match (activity.is_placed(), activity.handed_over()) {
            (true, true) => {}
            (true, false) => {
                set_open(by_open, ip, c, c.open.saturating_sub(1));
                c.freed.notify_one();
            }
            (false, true) => {}
            (false, false) => c.queued = c.queued.saturating_sub(1),
        }
        // Kept while a connection waits on its `freed`.
        if c.open == 0 && c.queued == 0 {
            clients.remove(&ip);
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
    /// Its oldest connection with no request yet, or a connection idle between requests, was
    /// told to close.
    Done,
    /// Its oldest connection with no request yet may be replaced at this instant.
    Later(Instant),
    /// Every connection is serving (a request in progress).
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
    /// until `deadline`; once `spoke` says the client sent its first bytes, it takes the place
    /// of one of the address's connections that has said nothing ([`Admission::take_over`]).
    /// `false`: no place came in time, or a newer connection replaced this one.
    pub(super) async fn wait_for_place(
        &self,
        freed: &Notify,
        deadline: Instant,
        spoke: impl std::future::Future<Output = bool>,
    ) -> bool {
        let (admission, ip, activity) = (&self.admission, self.ip, &self.activity);
        let waited = tokio::time::timeout_at(deadline, async {
            let mut spoke = std::pin::pin!(spoke);
            let mut listening = true;
            loop {
                if admission.take_place(ip, activity) {
                    return true;
                }
                tokio::select! {
                    () = freed.notified() => {}
                    () = activity.evicted() => return false,
                    said = &mut spoke, if listening => {
                        listening = false;
                        if said {
                            activity.spoke();
                            if admission.take_over(ip, activity) {
                                return true;
                            }
                        }
                    }
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

/// Keeps `a` among its address's connections holding a place, sweeping out those that closed
/// or were told to when the list grows past twice what it can hold.
fn push_placed(placed: &mut VecDeque<Weak<Activity>>, a: &Arc<Activity>, holds: usize) {
    placed.push_back(Arc::downgrade(a));
    if placed.len() > 2 * holds + 64 {
        placed.retain(|w| w.upgrade().is_some_and(|a| !a.told_to_close()));
    }
}

/// The connection of `placed` idle between requests for the longest, if any. A scan: it runs
/// only when the scope is full, and an address holds at most its limit.
fn pop_idle(placed: &mut VecDeque<Weak<Activity>>) -> Option<Arc<Activity>> {
    let mut best: Option<(Instant, Arc<Activity>)> = None;
    for a in placed.iter().filter_map(Weak::upgrade) {
        let Some(since) = a.idle_since() else {
            continue;
        };
        if best.as_ref().is_none_or(|(t, _)| since < *t) {
            best = Some((since, a));
        }
    }
    best.map(|(_, a)| a)
}

/// Sets the places `c` (client `ip`) holds, keeping the tables' order by size current.
fn set_open(by_open: &mut BTreeSet<(usize, IpAddr)>, ip: IpAddr, c: &mut Client, open: usize) {
    if c.open > 0 {
        by_open.remove(&(c.open, ip));
    }
    c.open = open;
    if open > 0 {
        by_open.insert((open, ip));
    }
}

fn is_waiting(w: &Weak<Activity>) -> bool {
    w.upgrade().is_some_and(|a| a.waiting())
}

/// The oldest connection of `queue` still waiting for its first request, if it has had
/// [`REPLACEABLE_AFTER`] to send it.
fn pop_waiting(queue: &mut VecDeque<Weak<Activity>>) -> Option<Arc<Activity>> {
    pop_oldest(queue, REPLACEABLE_AFTER, |_| true)
}

/// [`pop_waiting`] for an address's queue, skipping the connections that took a place since
/// they queued ([`Admission::take_place`] leaves them there). Replacing one of those as if it
/// were queued handed its place to a newcomer that only queued: the place was never given
/// back, and after enough of them the address's every place was held by nobody, its
/// connections all waiting for a place until their header deadline.
///
/// Any age will do, but never one that has spoken: a queued connection is not read, so one
/// that sent its request waits for a place ([`Admission::take_over`]), while a flood's
/// silent sockets turn over behind it. Refusing the newcomer while the queue was young
/// instead lost a fifth of the new connections of a client behind a flooder's NAT.
fn pop_queued(queue: &mut VecDeque<Weak<Activity>>) -> Option<Arc<Activity>> {
    pop_oldest(queue, Duration::ZERO, |a| !a.is_placed() && !a.has_spoken())
}

fn pop_oldest(
    queue: &mut VecDeque<Weak<Activity>>,
    min_age: Duration,
    keep: impl Fn(&Activity) -> bool,
) -> Option<Arc<Activity>> {
    while let Some(w) = queue.front() {
        match w.upgrade().filter(|a| a.waiting() && keep(a)) {
            // The queue is oldest first: if this one is too young, so are all after it.
            Some(a) if a.opened.elapsed() < min_age => return None,
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
mod tests;
