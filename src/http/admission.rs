//! Who may hold a listener's client connections. One client address holds at most
//! `max_connections_per_client` of them and the listeners of a door at most `max_connections`
//! together; when either is full, a newcomer takes the place of the OLDEST connection in that
//! scope that has not yet sent a complete request (its TLS handshake, h2 preface or first head
//! still to come), and only when every connection there is serving is the newcomer refused (the
//! address's limit: closed at once) or made to wait (the door's: accepting pauses, as before).
//!
//! Why replace rather than refuse: a flood of idle sockets from one address then churns through
//! its own share and nobody else's, while a real client behind the same address (a probe, a
//! NATed user) still gets in, since its connection is the newest and sends its request at once.
//! The door-wide replacement is what keeps the admin listener's probes answering with its table
//! full of idle sockets from many addresses, and the front door serving new clients with its
//! table full of half-open TLS handshakes.
//!
//! The tables sit behind one std mutex taken twice per connection (admitted, closed) and never
//! per request: a connection's requests only bump its [`Activity`]'s atomics. Connections that
//! served or closed stay in the queues until met at their head, or swept when a queue grows past
//! twice what it can hold, so a queue is bounded by its table.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};

use super::activity::Activity;

/// The client address limit and the queues of connections not serving yet.
#[derive(Debug)]
pub(super) struct Admission {
    pub(super) per_client: usize,
    max_connections: usize,
    tables: Mutex<Tables>,
    /// Connections closed at once: their address held its limit, all of them serving.
    pub(super) refused: AtomicU64,
    /// Connections closed before their first request to make room for a newer one.
    pub(super) replaced: AtomicU64,
}

#[derive(Debug, Default)]
struct Tables {
    clients: HashMap<IpAddr, Client>,
    /// Every connection of the door not serving yet, oldest first.
    waiting: VecDeque<Weak<Activity>>,
}

#[derive(Debug, Default)]
struct Client {
    open: usize,
    /// The address's connections not serving yet, oldest first.
    waiting: VecDeque<Weak<Activity>>,
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

    /// Counts a new connection from `ip` against its address. `None`: the address holds its
    /// limit and every one of its connections is serving; close this one.
    pub(super) fn admit(&self, ip: IpAddr, activity: &Arc<Activity>) -> Option<()> {
        let mut t = self.tables();
        let per_client = self.per_client;
        let client = t.clients.entry(ip).or_default();
        if client.open >= per_client {
            // Its place goes to the newcomer: the count stays as it is.
            let oldest = pop_waiting(&mut client.waiting)?;
            oldest.evict(true);
            self.replaced.fetch_add(1, Relaxed);
        } else {
            client.open += 1;
        }
        client.waiting.push_back(Arc::downgrade(activity));
        if client.waiting.len() > 2 * per_client + 8 {
            client.waiting.retain(is_waiting);
        }
        t.waiting.push_back(Arc::downgrade(activity));
        if t.waiting.len() > 2 * self.max_connections + 64 {
            t.waiting.retain(is_waiting);
        }
        Some(())
    }

    /// The door is full: closes its oldest connection not serving yet. `false`: all serve.
    pub(super) fn replace_oldest(&self) -> bool {
        let Some(oldest) = pop_waiting(&mut self.tables().waiting) else {
            return false;
        };
        oldest.evict(false);
        self.replaced.fetch_add(1, Relaxed);
        true
    }

    fn release(&self, ip: IpAddr, activity: &Activity) {
        let mut t = self.tables();
        // Read under the lock that `admit` sets it under.
        if activity.handed_over() {
            return;
        }
        if let Some(c) = t.clients.get_mut(&ip) {
            c.open = c.open.saturating_sub(1);
            if c.open == 0 {
                t.clients.remove(&ip);
            }
        }
    }

    /// Client addresses holding connections now.
    pub(super) fn clients(&self) -> usize {
        self.tables().clients.len()
    }
}

impl Ticket {
    pub(super) fn new(admission: &Arc<Admission>, ip: IpAddr, a: &Arc<Activity>) -> Ticket {
        Ticket {
            admission: admission.clone(),
            ip,
            activity: a.clone(),
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.admission.release(self.ip, &self.activity);
    }
}

fn is_waiting(w: &Weak<Activity>) -> bool {
    w.upgrade().is_some_and(|a| a.waiting())
}

/// The oldest connection of `queue` still waiting for its first request.
fn pop_waiting(queue: &mut VecDeque<Weak<Activity>>) -> Option<Arc<Activity>> {
    while let Some(w) = queue.pop_front() {
        if let Some(a) = w.upgrade().filter(|a| a.waiting()) {
            return Some(a);
        }
    }
    None
}
