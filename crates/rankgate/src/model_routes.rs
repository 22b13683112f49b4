//! Model routes (`[[routes]]`): a model name clients send (`chat`) that rankgate rewrites to one
//! of several models the engines serve, chosen by weight. An alias is one target; a canary or a
//! rollout is two, their weights shifted by reloads (the Gateway API Inference Extension's
//! InferenceModelRewrite). This file owns the table as the snapshot carries it (the catalog
//! holds it, so a reload swaps it with one store) and the choice of a target. The config builds
//! it (`config::model_routes`), `proxy::reroute` applies it to a request, once, before anything
//! reads the request's model.
//!
//! A leaf: it imports nothing of the crate, so the config, the catalog and the proxy all can.
//!
//! Without a sticky header the target is drawn at random by weight. With one, a request carrying
//! it goes where the header's value hashes: weighted rendezvous hashing (highest random weight,
//! Thaler and Ravishankar; weighted by Schindelhauer and Schomaker's logarithmic method, score
//! `w / -ln(h)`, the highest wins). Changing one target's weight moves only keys to that target
//! (raised) or away from it (lowered), never between the others; and the hash is fixed (FNV-1a
//! with the MurmurHash3 finalizer, no per-process seed), so every rankgate replica, and the next
//! process after a restart, sends one tenant to the same target.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use http::HeaderName;
use rand::Rng;
use serde_json::{json, Value};

/// One model a route sends to, and its share. A clone counts on the same counter.
#[derive(Debug, Clone)]
pub struct Target {
    pub model: Arc<str>,
    /// Its share among the route's targets; 0 takes nothing (a drained target kept listed).
    pub weight: u32,
    /// Requests the route sent here. Shared with the same route's same target in the next table
    /// ([`Routes::carry`]), so a reload that changes weights does not reset the counter.
    served: Arc<AtomicU64>,
    /// The target's own hash, mixed with each sticky key's.
    seed: u64,
}

impl Target {
    /// Requests the route has sent here (since this route and target first appeared).
    pub fn served(&self) -> u64 {
        self.served.load(Relaxed)
    }
}

/// One route: its name, its targets, and where a request may name its sticky key.
#[derive(Debug, Clone)]
pub struct Route {
    pub name: Arc<str>,
    pub targets: Box<[Target]>,
    /// The header whose value picks the target deterministically; `None`: at random by weight.
    pub sticky_header: Option<HeaderName>,
    /// The weights' sum (more than 0: the config refuses a route whose weights are all 0).
    total: u64,
    /// Its `/v1/models` entry, built once.
    entry: Value,
}

impl Route {
    /// A route to `targets` (model, weight), as the config validated them: at least one, weights
    /// not all 0.
    pub fn new(
        name: &str,
        targets: Vec<(String, u32)>,
        sticky_header: Option<HeaderName>,
    ) -> Route {
        let listed: Vec<Value> = (targets.iter())
            .map(|(model, weight)| json!({"model": model, "weight": weight}))
            .collect();
        let targets: Box<[Target]> = (targets.into_iter())
            .map(|(model, weight)| Target {
                seed: mix(fnv1a(model.as_bytes())),
                model: model.into(),
                weight,
                served: Arc::default(),
            })
            .collect();
        Route {
            total: targets.iter().map(|t| u64::from(t.weight)).sum(),
            entry: json!({"id": name, "object": "model", "created": 0, "owned_by": "rankgate",
                "targets": listed}),
            name: name.into(),
            targets,
            sticky_header,
        }
    }

    /// The target of a request: by `key` (the sticky header's value) when it has one, else
    /// drawn from `rng` by weight. Counted as served.
    pub fn choose(&self, key: Option<&[u8]>, rng: &mut impl Rng) -> &Target {
        let i = match key {
            Some(key) => self.by_key(key),
            None => self.by_draw(rng.random_range(0..self.total.max(1))),
        };
        let target = &self.targets[i];
        target.served.fetch_add(1, Relaxed);
        target
    }

    /// The target a draw in `0..total` falls on: each target owns a run of draws as long as its
    /// weight, so a weight-0 target owns none.
    pub fn by_draw(&self, mut draw: u64) -> usize {
        for (i, t) in self.targets.iter().enumerate() {
            match draw.checked_sub(u64::from(t.weight)) {
                Some(rest) => draw = rest,
                None => return i,
            }
        }
        // Past the total (not from `choose`): the last target that takes anything.
        self.targets.iter().rposition(|t| t.weight > 0).unwrap_or(0)
    }

    /// The target `key` goes to: the highest `weight / -ln(h)`, `h` the key's hash with the
    /// target's, read as a number in (0, 1). Weight-0 targets never score.
    pub fn by_key(&self, key: &[u8]) -> usize {
        let key = mix(fnv1a(key));
        let mut best = (0, f64::NEG_INFINITY);
        for (i, t) in self.targets.iter().enumerate() {
            if t.weight == 0 {
                continue;
            }
            let score = f64::from(t.weight) / -unit(mix(key ^ t.seed)).ln();
            if score > best.1 {
                best = (i, score);
            }
        }
        best.0
    }

    /// The route's `/v1/models` entry: `owned_by` rankgate, with its targets and weights.
    pub fn entry(&self) -> &Value {
        &self.entry
    }
}

/// Two routes are the same when they send the same way (their counters aside).
impl PartialEq for Route {
    fn eq(&self, other: &Route) -> bool {
        let same = |a: &Target, b: &Target| a.model == b.model && a.weight == b.weight;
        self.name == other.name
            && self.sticky_header == other.sticky_header
            && self.targets.len() == other.targets.len()
            && (self.targets.iter().zip(other.targets.iter())).all(|(a, b)| same(a, b))
    }
}

/// A LoRA adapter `[[adapters]]` declares: rankgate loads it (`crate::adapter_loads`) on a
/// server of its `base` model when a request names it and no server serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Declared {
    pub name: Arc<str>,
    pub base: Arc<str>,
    /// Where the engine reads it from: a path on the engine's filesystem or a repository id,
    /// as vLLM's `lora_path` takes it.
    pub path: Arc<str>,
}

/// Every route, by name, and the adapters `[[adapters]]` declares: the model names rankgate
/// knows beyond the engines' own lists. Empty unless the config has some: then a request costs
/// one look at [`Routes::is_empty`].
#[derive(Debug, Default, PartialEq)]
pub struct Routes {
    routes: Vec<Route>,
    by_name: HashMap<Arc<str>, usize>,
    adapters: Vec<Declared>,
}

impl Routes {
    /// `routes`, named once each (the config refuses a name given twice; a later one would
    /// shadow the earlier here).
    pub fn new(routes: Vec<Route>) -> Routes {
        let by_name = (routes.iter().enumerate())
            .map(|(i, r)| (r.name.clone(), i))
            .collect();
        Routes {
            routes,
            by_name,
            adapters: Vec::new(),
        }
    }

    /// These routes with `adapters` declared.
    pub fn with_adapters(self, adapters: Vec<Declared>) -> Routes {
        Routes { adapters, ..self }
    }

    /// The declared adapter called `name`.
    pub fn declared(&self, name: &str) -> Option<&Declared> {
        self.adapters.iter().find(|a| &*a.name == name)
    }

    /// The declared adapters, in the file's order.
    pub fn adapters(&self) -> &[Declared] {
        &self.adapters
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }

    /// The route called `name`.
    pub fn get(&self, name: &str) -> Option<&Route> {
        self.by_name.get(name).map(|&i| &self.routes[i])
    }

    /// The routes in the file's order.
    pub fn iter(&self) -> impl Iterator<Item = &Route> {
        self.routes.iter()
    }

    /// These routes, each target counting on from `old`'s count of the same route and model
    /// (a reload that moves weight does not reset what `/metrics` counted).
    pub fn carry(&self, old: &Routes) -> Routes {
        let mut routes = self.routes.clone();
        for route in &mut routes {
            let Some(was) = old.get(&route.name) else {
                continue;
            };
            for t in route.targets.iter_mut() {
                if let Some(w) = was.targets.iter().find(|w| w.model == t.model) {
                    t.served = w.served.clone();
                }
            }
        }
        Routes::new(routes).with_adapters(self.adapters.clone())
    }
}

/// FNV-1a, 64 bits: fixed, so every process hashes a key alike.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// MurmurHash3's 64-bit finalizer: every input bit moves every output bit, which FNV alone
/// does poorly for the high bits read by [`unit`].
fn mix(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// A hash as a number in (0, 1), never 0 or 1 (whose logarithms would be infinite or 0): its
/// top 53 bits, centred in their step.
fn unit(h: u64) -> f64 {
    ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests;
