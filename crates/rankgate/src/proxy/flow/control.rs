//! [`Flows`]: one router's queue, what wakes it, and who leaves it when.
//!
//! A request arriving while nothing waits and a rank it may use has room goes at once. Else it
//! waits, and [`Flows::pump`] sends the next ones on (the queue's order, each only if one of its
//! ranks has room) whenever room may have appeared: a request ends (its answer's [`Charge`]
//! drops), telemetry is published, a request arrives. No loop polls. The rank itself is picked
//! after the request leaves the queue, by the pick below, with that moment's telemetry and
//! prefix affinity (late binding).
//!
//! Between a request leaving and its pick marking it in flight on a rank, it is `pending`: the
//! room the pump sees is the fleet's less the requests already on their way to it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::oneshot;

use super::charge::{Pending, Wake};
use super::queue::{Caps, Full, Queue, Tenant, Waiter};
use super::refusal::Refusal;
use super::stats::ObjectiveStats;
use crate::config::FlowConfig;
use crate::policy::{Avoid, Leg, Selector};
use crate::prompt::Prompt;
use crate::proxy::disagg::Split;
use crate::table::Table;

/// Candidates the pump looks at per wake: bounds the time it holds the lock.
const LOOK: usize = 256;

/// The ranks a request may go to, as its pick will see them.
#[derive(Debug)]
pub enum Eligible {
    Whole(Avoid),
    /// A disaggregated request: a prefill rank and a decode rank, each side judged by its own.
    Split(Box<(Avoid, Avoid)>),
}

impl Eligible {
    pub fn of(avoid: Option<&Avoid>, split: Option<&Split>) -> Eligible {
        match split {
            Some(s) => Eligible::Split(Box::new((s.avoid(Leg::Prefill), s.avoid(Leg::Decode)))),
            None => Eligible::Whole(avoid.cloned().unwrap_or_default()),
        }
    }
}

/// What a waiting request is told.
#[derive(Debug)]
pub enum Go {
    Send(Pending),
    Refuse(Refusal),
}

#[derive(Debug)]
pub struct Item {
    go: oneshot::Sender<Go>,
    eligible: Eligible,
    /// Its prompt, where prefix affinity weighs it: a request whose prefix is cached where
    /// room appears goes first within its band.
    prompt: Option<Prompt>,
}

/// What an arriving request is: its objective (index), its body's bytes, what it costs its
/// tenant when it leaves (prompt tokens) and at what weight.
#[derive(Debug, Clone, Copy)]
pub struct Ask {
    pub objective: usize,
    pub bytes: u64,
    pub cost: u64,
    pub weight: f64,
}

/// Where a request stands after [`Flows::arrive`].
pub enum Arrival {
    /// Room now: go.
    Now(Arc<Tenant>, Pending),
    /// Queued: wait on the receiver; leave with the seq if it gives up.
    Queued(Arc<Tenant>, u64, oneshot::Receiver<Go>),
    Refused(Arc<Tenant>, Refusal),
}

pub struct Flows {
    pub cfg: Arc<FlowConfig>,
    /// Each objective's band (objectives of one priority share one).
    pub band_of: Box<[usize]>,
    /// Per band: the room its requests leave free for the bands above it (their `reserve`s).
    keep: Box<[u64]>,
    queue: Mutex<Queue<Item>>,
    pending: Arc<AtomicU64>,
    /// Requests waiting (read without the lock), and the dispatcher's wake.
    pub wake: Arc<Wake>,
    closed: AtomicBool,
    selector: Arc<Selector>,
    table: Arc<Table>,
    pub stats: Box<[ObjectiveStats]>,
}

impl std::fmt::Debug for Flows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Flows({} waiting)", self.wake.waiting.load(Relaxed))
    }
}

impl Flows {
    pub fn new(cfg: &FlowConfig, selector: &Arc<Selector>, table: &Arc<Table>) -> Arc<Flows> {
        let mut band_of = Vec::with_capacity(cfg.objectives.len());
        let mut band = 0;
        for (i, o) in cfg.objectives.iter().enumerate() {
            if i > 0 && o.priority != cfg.objectives[i - 1].priority {
                band += 1;
            }
            band_of.push(band);
        }
        // Bands are in priority order: each keeps what every band above it reserves.
        let mut keep = vec![0u64; band + 1];
        for (o, &b) in cfg.objectives.iter().zip(&band_of) {
            for k in keep.iter_mut().skip(b + 1) {
                *k += o.reserve as u64;
            }
        }
        let caps = Caps {
            count: cfg.max_queued,
            bytes: cfg.max_queued_bytes,
            tenant_count: cfg.max_queued_per_tenant,
            tenant_bytes: cfg.max_queued_bytes_per_tenant,
            tenants: cfg.max_tenants,
        };
        Arc::new(Flows {
            queue: Mutex::new(Queue::new(band + 1, caps)),
            band_of: band_of.into(),
            keep: keep.into(),
            pending: Arc::default(),
            wake: Arc::default(),
            closed: AtomicBool::new(false),
            selector: selector.clone(),
            table: table.clone(),
            stats: cfg.objectives.iter().map(|_| Default::default()).collect(),
            cfg: Arc::new(cfg.clone()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Queue<Item>> {
        // The queue's invariants hold between statements: a panic elsewhere leaves it usable.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the ranks `e` allows have room beyond the `pending` requests on their way and
    /// what is kept free for the bands above `band`; true when there is no telemetry to judge
    /// by (the pick decides).
    fn fits(&self, e: &Eligible, pending: u64, band: usize) -> bool {
        match e {
            Eligible::Whole(a) => self.whole_fits(a, pending, band),
            Eligible::Split(legs) => {
                self.whole_fits(&legs.0, pending, band) && self.whole_fits(&legs.1, pending, band)
            }
        }
    }

    fn whole_fits(&self, a: &Avoid, pending: u64, band: usize) -> bool {
        let taken = pending.saturating_add(self.keep[band]);
        (self.selector.room_above(&self.table, a, taken)).unwrap_or(true)
    }

    /// [`Flows::fits`] for a request's own `Avoid` or `Split`, nothing cloned for a whole one.
    fn fits_request(
        &self,
        avoid: Option<&Avoid>,
        split: Option<&Split>,
        pending: u64,
        band: usize,
    ) -> bool {
        match (split, avoid) {
            (Some(s), _) => self.fits(&Eligible::of(None, Some(s)), pending, band),
            (None, Some(a)) => self.whole_fits(a, pending, band),
            (None, None) => self.whole_fits(&Avoid::default(), pending, band),
        }
    }

    fn pending(&self) -> Pending {
        self.pending.fetch_add(1, Relaxed);
        Pending(self.pending.clone())
    }

    /// A request of `tenant` arrives (its objective, size and cost in `w`; where it may go in
    /// `avoid` or `split`): it goes now, waits, or is refused.
    pub fn arrive(
        &self,
        tenant: &str,
        w: Ask,
        avoid: Option<&Avoid>,
        split: Option<&Split>,
        prompt: impl FnOnce() -> Option<Prompt>,
    ) -> Arrival {
        let objective = w.objective;
        let band = self.band_of[objective];
        let mut q = self.lock();
        let tenant = q.tenant(tenant);
        if q.len() == 0 && self.fits_request(avoid, split, self.pending.load(Relaxed), band) {
            tenant.charge(band, w.cost, w.weight);
            tenant.dispatched.fetch_add(1, Relaxed);
            self.stats[objective].direct.fetch_add(1, Relaxed);
            return Arrival::Now(tenant, self.pending());
        }
        if self.closed.load(Relaxed) {
            return Arrival::Refused(tenant, Refusal::ShuttingDown);
        }
        let (tx, rx) = oneshot::channel();
        let w = Waiter {
            seq: 0,
            bytes: w.bytes,
            cost: w.cost,
            weight: w.weight,
            since: tokio::time::Instant::now(),
            objective,
            item: Item {
                go: tx,
                eligible: Eligible::of(avoid, split),
                prompt: self.selector.affinity().then(prompt).flatten(),
            },
        };
        match q.push(band, &tenant, w) {
            Ok(seq) => {
                self.stats[objective].queued.fetch_add(1, Relaxed);
                self.wake.waiting.store(q.len(), Relaxed);
                // Room may be there for it already (another request waited for other ranks).
                self.pump_locked(&mut q);
                Arrival::Queued(tenant, seq, rx)
            }
            Err((full, _)) => Arrival::Refused(
                tenant,
                match full {
                    Full::All => Refusal::QueueFull,
                    Full::Tenant => Refusal::TenantFull,
                },
            ),
        }
    }

    /// Takes request `seq` out of the queue; false if it was not there (it was sent or refused
    /// already, and its answer is in its channel).
    pub fn leave(&self, objective: usize, tenant: &Arc<Tenant>, seq: u64) -> bool {
        let mut q = self.lock();
        let left = q.remove(self.band_of[objective], tenant, seq).is_some();
        if left {
            self.stats[objective].queued.fetch_sub(1, Relaxed);
            self.wake.waiting.store(q.len(), Relaxed);
        }
        left
    }

    /// Sends on every waiting request that fits now, in the queue's order.
    pub fn pump(&self) {
        let mut q = self.lock();
        self.pump_locked(&mut q);
    }

    fn pump_locked(&self, q: &mut Queue<Item>) {
        let mut look = LOOK;
        while q.len() > 0 {
            let pending = self.pending.load(Relaxed);
            let band_of = &self.band_of;
            let fits =
                |w: &Waiter<Item>| self.fits(&w.item.eligible, pending, band_of[w.objective]);
            let prefers = |w: &Waiter<Item>| self.cached_has_room(&w.item);
            let Some((tenant, w)) = q.next(&mut look, fits, prefers) else {
                break;
            };
            let stats = &self.stats[w.objective];
            stats.queued.fetch_sub(1, Relaxed);
            stats.dispatched.fetch_add(1, Relaxed);
            stats.wait.observe(w.since.elapsed());
            tenant.dispatched.fetch_add(1, Relaxed);
            // A receiver gone (its client left as it was chosen) drops the guard at once.
            let _ = w.item.go.send(Go::Send(self.pending()));
        }
        self.wake.waiting.store(q.len(), Relaxed);
    }

    /// Whether `item`'s prompt is cached where there is room now (its prefill leg's side, for
    /// a disaggregated request).
    fn cached_has_room(&self, item: &Item) -> bool {
        let Some(prompt) = &item.prompt else {
            return false;
        };
        let avoid = match &item.eligible {
            Eligible::Whole(a) => a,
            Eligible::Split(legs) => &legs.0,
        };
        self.selector.cached_has_room(&self.table, avoid, prompt) == Some(true)
    }

    /// Requests waiting now.
    pub fn waiting(&self) -> usize {
        self.wake.waiting.load(Relaxed)
    }

    /// Refuses everything waiting (shutdown: the drain grace ran out) and anything that arrives
    /// later and would wait.
    pub fn close(&self) {
        self.closed.store(true, Relaxed);
        let all = self.lock().take_all();
        self.wake.waiting.store(0, Relaxed);
        for (_, w) in all {
            let stats = &self.stats[w.objective];
            stats.queued.fetch_sub(1, Relaxed);
            let _ = w.item.go.send(Go::Refuse(Refusal::ShuttingDown));
        }
    }

    /// The tenants tracked (for `/metrics` and `/flows`).
    pub fn tenants(&self) -> Vec<Arc<Tenant>> {
        self.lock().tenants().cloned().collect()
    }

    /// Requests waiting per band (for `/flows`).
    pub fn per_band(&self) -> Vec<usize> {
        self.lock().per_band()
    }

    /// The dispatcher: pumps whenever a request ends or telemetry is published, until `stop`.
    pub async fn run(self: Arc<Self>, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            tokio::select! {
                _ = self.wake.kick.notified() => {}
                _ = self.table.published.notified() => {}
                _ = crate::http::shutdown_signalled(&mut stop) => return,
            }
            if self.waiting() > 0 {
                self.pump();
            }
        }
    }
}
