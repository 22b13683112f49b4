//! The queue itself, as data: requests held by priority band (objectives of one priority share
//! a band), within a band by tenant, within a tenant first come first served. Which one leaves
//! next: the highest band first, strictly; within it the tenant that has cost the least so far
//! (its virtual tokens: prompt tokens at dispatch and output tokens as they stream, each divided
//! by its objective's weight); within the tenant, its oldest request.
//!
//! A tenant that had nothing waiting starts again level with the least-served tenant waiting in
//! the band, not below it: time spent idle is not credit to spend in a burst.
//!
//! Bounded everywhere a stranger could grow it: requests and bytes in all and per tenant, and the
//! tenants tracked (idle ones are forgotten when the table is full; past that, new tenants share
//! one, `other`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use tokio::time::Instant;

/// The tenant new tenants share when the table is full of busy ones.
pub const OVERFLOW: &str = "~overflow";
/// A band's least-served tenants among which one better placed may go first.
pub const PREFER_AMONG: usize = 8;
/// Virtual tokens are kept in thousandths, so a weight below 1 still counts.
pub const MILLI: f64 = 1000.0;

/// One tenant: what it has waiting, in flight and has cost. Shared (`Arc`) with the requests
/// it has in flight, which charge it as their answers stream.
#[derive(Debug)]
pub struct Tenant {
    pub name: Arc<str>,
    /// Virtual tokens (thousandths, weighted) per band.
    vtime: Box<[AtomicU64]>,
    /// Tokens it has cost, unweighted (prompt at dispatch, output as it streams).
    pub tokens: AtomicU64,
    pub in_flight: AtomicU32,
    pub queued: AtomicUsize,
    pub queued_bytes: AtomicU64,
    pub dispatched: AtomicU64,
    pub rejected: AtomicU64,
}

impl Tenant {
    fn new(name: Arc<str>, bands: usize) -> Tenant {
        Tenant {
            name,
            vtime: (0..bands).map(|_| AtomicU64::new(0)).collect(),
            tokens: AtomicU64::new(0),
            in_flight: AtomicU32::new(0),
            queued: AtomicUsize::new(0),
            queued_bytes: AtomicU64::new(0),
            dispatched: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
        }
    }

    /// Charges `tokens` to the tenant in `band`, at `weight` (the objective's).
    pub fn charge(&self, band: usize, tokens: u64, weight: f64) {
        self.tokens.fetch_add(tokens, Relaxed);
        let v = (tokens as f64 * MILLI / weight) as u64;
        if let Some(t) = self.vtime.get(band) {
            t.fetch_add(v, Relaxed);
        }
    }

    pub fn vtime(&self, band: usize) -> u64 {
        self.vtime.get(band).map_or(0, |t| t.load(Relaxed))
    }

    #[cfg(test)]
    pub fn for_tests(name: &str) -> Tenant {
        Tenant::new(name.into(), 1)
    }

    fn idle(&self) -> bool {
        self.queued.load(Relaxed) == 0 && self.in_flight.load(Relaxed) == 0
    }
}

/// A request waiting: what it costs, how big it is, and whatever the caller needs to send it on
/// (`T`: the channel that wakes it, and what it may be sent to).
#[derive(Debug)]
pub struct Waiter<T> {
    pub seq: u64,
    pub bytes: u64,
    /// Prompt tokens (or the body's estimate), charged when it leaves.
    pub cost: u64,
    pub weight: f64,
    pub since: Instant,
    pub objective: usize,
    pub item: T,
}

/// Why a request is not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// `flow.max_queued` or `flow.max_queued_bytes`.
    All,
    /// `flow.max_queued_per_tenant` or `flow.max_queued_bytes_per_tenant`.
    Tenant,
}

/// The bounds the queue keeps.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    pub count: usize,
    pub bytes: u64,
    pub tenant_count: usize,
    pub tenant_bytes: u64,
    pub tenants: usize,
}

struct Flow<T> {
    tenant: Arc<Tenant>,
    waiting: VecDeque<Waiter<T>>,
}

pub struct Queue<T> {
    /// Per band (highest priority first): the tenants with requests waiting in it.
    bands: Vec<Vec<Flow<T>>>,
    /// Keyed by a seed drawn at start: tenant ids are a stranger's to choose.
    tenants: HashMap<Arc<str>, Arc<Tenant>, foldhash::fast::RandomState>,
    overflow: Arc<Tenant>,
    caps: Caps,
    count: usize,
    bytes: u64,
    seq: u64,
}

impl<T> Queue<T> {
    pub fn new(bands: usize, caps: Caps) -> Queue<T> {
        Queue {
            bands: (0..bands).map(|_| Vec::new()).collect(),
            tenants: HashMap::default(),
            overflow: Arc::new(Tenant::new(OVERFLOW.into(), bands)),
            caps,
            count: 0,
            bytes: 0,
            seq: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.count
    }

    #[cfg(test)]
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The tenant called `name`, tracked from now on if it was not. When the table is full,
    /// the idle tenants are forgotten first; when none is idle, `name` shares [`OVERFLOW`].
    pub fn tenant(&mut self, name: &str) -> Arc<Tenant> {
        if let Some(t) = self.tenants.get(name) {
            return t.clone();
        }
        if self.tenants.len() >= self.caps.tenants {
            // All at once: the scan is paid once per table's worth of new tenants.
            self.tenants.retain(|_, t| !t.idle());
            if self.tenants.len() >= self.caps.tenants {
                return self.overflow.clone();
            }
        }
        let name: Arc<str> = name.into();
        let t = Arc::new(Tenant::new(name.clone(), self.bands.len()));
        self.tenants.insert(name, t.clone());
        t
    }

    /// Every tenant tracked, the shared overflow one included.
    pub fn tenants(&self) -> impl Iterator<Item = &Arc<Tenant>> {
        self.tenants.values().chain(std::iter::once(&self.overflow))
    }

    /// Queues `w` for `tenant` in `band`; its `seq` is set here and returned.
    pub fn push(
        &mut self,
        band: usize,
        tenant: &Arc<Tenant>,
        mut w: Waiter<T>,
    ) -> Result<u64, (Full, Waiter<T>)> {
        let c = &self.caps;
        if self.count >= c.count || self.bytes.saturating_add(w.bytes) > c.bytes {
            return Err((Full::All, w));
        }
        let (queued, queued_bytes) = (
            tenant.queued.load(Relaxed),
            tenant.queued_bytes.load(Relaxed),
        );
        if queued >= c.tenant_count || queued_bytes.saturating_add(w.bytes) > c.tenant_bytes {
            return Err((Full::Tenant, w));
        }
        let Some(flows) = self.bands.get_mut(band) else {
            return Err((Full::All, w));
        };
        self.seq += 1;
        w.seq = self.seq;
        let seq = w.seq;
        tenant.queued.fetch_add(1, Relaxed);
        tenant.queued_bytes.fetch_add(w.bytes, Relaxed);
        self.count += 1;
        self.bytes += w.bytes;
        match flows.iter_mut().find(|f| Arc::ptr_eq(&f.tenant, tenant)) {
            Some(f) => f.waiting.push_back(w),
            None => {
                // Back from idle: level with the least-served tenant waiting, no lower.
                let floor = flows.iter().map(|f| f.tenant.vtime(band)).min();
                if let (Some(floor), Some(v)) = (floor, tenant.vtime.get(band)) {
                    v.fetch_max(floor, Relaxed);
                }
                flows.push(Flow {
                    tenant: tenant.clone(),
                    waiting: VecDeque::from([w]),
                });
            }
        }
        Ok(seq)
    }

    /// Takes the request `seq` of `tenant` in `band` out of the queue (its client left, or its
    /// wait ran out); `None` if it is not there (it left already).
    pub fn remove(&mut self, band: usize, tenant: &Arc<Tenant>, seq: u64) -> Option<Waiter<T>> {
        let flows = self.bands.get_mut(band)?;
        let i = flows.iter().position(|f| Arc::ptr_eq(&f.tenant, tenant))?;
        let at = flows[i].waiting.iter().position(|w| w.seq == seq)?;
        let w = flows[i].waiting.remove(at)?;
        if flows[i].waiting.is_empty() {
            flows.swap_remove(i);
        }
        self.forget(tenant, &w);
        Some(w)
    }

    fn forget(&mut self, tenant: &Tenant, w: &Waiter<T>) {
        tenant.queued.fetch_sub(1, Relaxed);
        tenant.queued_bytes.fetch_sub(w.bytes, Relaxed);
        self.count -= 1;
        self.bytes -= w.bytes;
    }

    /// The next request to leave, among the first `look` candidates in order (band, then the
    /// least-served tenant), whose `fits` says it may go now; it is charged its cost. A
    /// tenant whose oldest request does not fit is passed over whole (first come first served
    /// within a tenant), and so is a band that has none that fits: a request held for ranks that
    /// are full never holds back one for ranks that have room.
    ///
    /// Within the band that goes, a fitting request `prefers` says is better placed now (its
    /// prompt's prefix is cached where the room is: late binding that keeps affinity) goes
    /// before the least-served tenant's, if it is among the [`PREFER_AMONG`] least served.
    pub fn next(
        &mut self,
        look: &mut usize,
        mut fits: impl FnMut(&Waiter<T>) -> bool,
        mut prefers: impl FnMut(&Waiter<T>) -> bool,
    ) -> Option<(Arc<Tenant>, Waiter<T>)> {
        for band in 0..self.bands.len() {
            let flows = &self.bands[band];
            let mut order: Vec<(u64, usize)> = (flows.iter().enumerate())
                .map(|(i, f)| (f.tenant.vtime(band), i))
                .collect();
            order.sort_unstable();
            let mut first = None;
            for (rank, &(_, i)) in order.iter().enumerate() {
                if *look == 0 || (first.is_some() && rank >= PREFER_AMONG) {
                    break;
                }
                *look -= 1;
                let Some(head) = flows[i].waiting.front() else {
                    continue;
                };
                if !fits(head) {
                    continue;
                }
                if prefers(head) {
                    first = Some(i);
                    break;
                }
                first = first.or(Some(i));
            }
            if let Some(i) = first {
                return self.take(band, i);
            }
            if *look == 0 {
                return None;
            }
        }
        None
    }

    /// The oldest request of flow `i` in `band`, out of the queue and charged.
    fn take(&mut self, band: usize, i: usize) -> Option<(Arc<Tenant>, Waiter<T>)> {
        let flows = &mut self.bands[band];
        let tenant = flows[i].tenant.clone();
        let w = flows[i].waiting.pop_front()?;
        if flows[i].waiting.is_empty() {
            flows.swap_remove(i);
        }
        self.forget(&tenant, &w);
        tenant.charge(band, w.cost, w.weight);
        Some((tenant, w))
    }

    /// Everything waiting, taken out (shutdown).
    pub fn take_all(&mut self) -> Vec<(Arc<Tenant>, Waiter<T>)> {
        let mut out = Vec::with_capacity(self.count);
        for flows in &mut self.bands {
            for f in flows.drain(..) {
                for w in f.waiting {
                    out.push((f.tenant.clone(), w));
                }
            }
        }
        for (t, w) in &out {
            t.queued.fetch_sub(1, Relaxed);
            t.queued_bytes.fetch_sub(w.bytes, Relaxed);
        }
        self.count = 0;
        self.bytes = 0;
        out
    }

    /// Requests waiting per band.
    pub fn per_band(&self) -> Vec<usize> {
        (self.bands.iter())
            .map(|flows| flows.iter().map(|f| f.waiting.len()).sum())
            .collect()
    }
}

#[cfg(test)]
#[path = "queue_tests.rs"]
mod tests;
