//! The `model` label, and a request's labels: small indices on the request path, names only at
//! scrape time. The `route` label's fixed list is in `routes`.
//!
//! Clients choose paths and model names, so neither is ever copied into a label: a route is one
//! of a fixed list (the route table, the fleet's own endpoints, `server.extra_routes`, the gRPC
//! methods, and `unmatched`), a model one the fleet's catalog knows, or `unknown`. Whatever
//! clients send, the series stay as many as the fleet has routes and models.
//!
//! A request carries its labels as two `u16`s: no string is built, hashed into a map, or
//! reference-counted per request. Route indices are fixed at startup. Model indices are
//! interned once per model name and never reused, so an index recorded before a catalog change
//! still names the same model after it; the per-model histograms live with the interned name.

use std::sync::atomic::{
    AtomicU16, AtomicUsize, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use arc_swap::ArcSwap;

use super::histogram::Histogram;
use super::routes::RouteIdx;
use crate::catalog::Catalog;
use crate::ix::{EngineIx, Ix};

/// The `model` label of requests whose model the fleet's catalog does not know (or that name
/// none where the fleet serves several).
pub const UNKNOWN: &str = "unknown";

/// Most models ever labelled; past it new names count as `unknown` (a fleet that cycles
/// through more models than this over one process's life is not one we label well anyway).
const MAX_MODELS: usize = 1024;

/// Most model names ever labelled from requests alone, before the engines' lists said them
/// (see [`Models::provisional`]): clients choose these, so only a few are believed.
const MAX_PROVISIONAL: usize = 8;
/// Longest model name labelled from a request alone.
const MAX_PROVISIONAL_LEN: usize = 256;

/// A request's `model` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelIdx(pub(super) u16);

impl ModelIdx {
    pub const UNKNOWN: ModelIdx = ModelIdx(0);
}

/// What a request is labelled with, besides its status and worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestLabels {
    pub model: ModelIdx,
    pub route: RouteIdx,
}

/// One model's series: its name and histograms. Never removed: a model that left the fleet
/// keeps its counts, as a counter must.
#[derive(Debug)]
pub struct ModelSeries {
    pub name: Arc<str>,
    pub duration: Histogram,
    pub first_byte: Histogram,
}

/// The model labels the current catalog allows, resolved once per catalog.
#[derive(Debug, Default)]
pub struct CatalogLabels {
    /// The catalog these are for; held so that its address cannot be reused by another.
    catalog: Option<Arc<Catalog>>,
    /// The fleet's one model when it serves one (requests are then not scanned): every
    /// request's label. `UNKNOWN` otherwise.
    pub only: ModelIdx,
    /// Requests' models decide their engines, so each request's is read (by `select`).
    pub by_model: bool,
    /// Some engine's model list is not known yet: requests' models are read for their label
    /// (see [`Models::provisional`]), so the first requests are not all `unknown`.
    pub pending: bool,
    /// The catalog's model names, sorted, with their index.
    names: Vec<(Arc<str>, ModelIdx)>,
}

impl CatalogLabels {
    /// The label of a request naming `model`.
    pub fn of(&self, model: &str) -> ModelIdx {
        match self.names.binary_search_by(|(n, _)| (**n).cmp(model)) {
            Ok(i) => self.names[i].1,
            Err(_) => ModelIdx::UNKNOWN,
        }
    }
}

impl Default for ModelIdx {
    fn default() -> ModelIdx {
        ModelIdx::UNKNOWN
    }
}

/// Models per segment of [`Interned`].
const SEGMENT: usize = 32;

/// Every model ever labelled, indexed by [`ModelIdx`], only ever appended to: a slot once
/// filled never changes, so the request path reads one with two atomic loads, no lock and no
/// reference count. Segments are allocated as models arrive.
struct Interned {
    segments: [OnceLock<Box<[OnceLock<ModelSeries>; SEGMENT]>>; MAX_MODELS / SEGMENT],
    len: AtomicUsize,
}

impl Interned {
    #[inline]
    fn get(&self, i: usize) -> Option<&ModelSeries> {
        self.segments.get(i / SEGMENT)?.get()?[i % SEGMENT].get()
    }

    /// Appends `s`, if there is room; the caller holds [`Models::grow`].
    fn push(&self, s: ModelSeries) -> Option<usize> {
        let i = self.len.load(Acquire);
        let segment = self.segments.get(i / SEGMENT)?;
        let segment = segment.get_or_init(|| Box::new(std::array::from_fn(|_| OnceLock::new())));
        let _ = segment[i % SEGMENT].set(s);
        self.len.store(i + 1, Release);
        Some(i)
    }

    fn iter(&self) -> impl Iterator<Item = &ModelSeries> {
        (0..self.len.load(Acquire)).filter_map(|i| self.get(i))
    }
}

impl std::fmt::Debug for Interned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.iter().map(|s| &s.name))
            .finish()
    }
}

/// Every model ever labelled, and the labels of the current catalog.
#[derive(Debug)]
pub struct Models {
    /// Index 0 is `unknown`.
    interned: Interned,
    current: ArcSwap<CatalogLabels>,
    /// Held while names are interned.
    grow: Mutex<()>,
    /// Names interned by [`Models::provisional`], never more than [`MAX_PROVISIONAL`].
    provisional: AtomicUsize,
}

impl Default for Models {
    fn default() -> Models {
        let models = Models {
            interned: Interned {
                segments: std::array::from_fn(|_| OnceLock::new()),
                len: AtomicUsize::new(0),
            },
            current: ArcSwap::default(),
            grow: Mutex::new(()),
            provisional: AtomicUsize::new(0),
        };
        models.interned.push(series(UNKNOWN.into()));
        models
    }
}

fn series(name: Arc<str>) -> ModelSeries {
    ModelSeries {
        name,
        duration: Histogram::default(),
        first_byte: Histogram::default(),
    }
}

impl Models {
    /// The labels of `catalog` (of a fleet of `engines` engines): cached, so the usual call is
    /// one pointer comparison.
    pub fn labels(
        &self,
        catalog: &Arc<Catalog>,
        engines: usize,
    ) -> arc_swap::Guard<Arc<CatalogLabels>> {
        let cur = self.current.load();
        if cur
            .catalog
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(c, catalog))
        {
            return cur;
        }
        drop(cur);
        self.resolve(catalog, engines);
        self.current.load()
    }

    /// Interns the names of a new catalog.
    #[cold]
    fn resolve(&self, catalog: &Arc<Catalog>, engines: usize) {
        let _grow = self.grow.lock().unwrap_or_else(PoisonError::into_inner);
        let cur = self.current.load();
        if cur
            .catalog
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(c, catalog))
        {
            return;
        }
        let mut ids: Vec<&str> = (0..engines)
            .filter_map(|e| catalog.of(EngineIx::new(e)))
            .flatten()
            .map(|m| m.id.as_str())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        let mut names = Vec::with_capacity(ids.len());
        for id in ids {
            // A model named `unknown` is counted with the unknown ones: one label value, one
            // series.
            let found = self.interned.iter().position(|s| &*s.name == id);
            let Some(i) = found.or_else(|| self.interned.push(series(id.into()))) else {
                continue;
            };
            if let Some(s) = self.interned.get(i) {
                names.push((s.name.clone(), ModelIdx(i as u16)));
            }
        }
        let only = match (catalog.routes_by_model(), names.as_slice()) {
            (false, [(_, idx)]) => *idx,
            _ => ModelIdx::UNKNOWN,
        };
        self.current.store(Arc::new(CatalogLabels {
            catalog: Some(catalog.clone()),
            only,
            by_model: catalog.routes_by_model(),
            pending: catalog.lists_pending(),
            names,
        }));
    }

    /// The label of a request naming `model` while some engine's list is not known yet: the
    /// catalog's, else the name itself, interned for good (once the lists are read, a model
    /// they have keeps the same label). Clients choose names, so at most [`MAX_PROVISIONAL`]
    /// are ever taken this way, none longer than [`MAX_PROVISIONAL_LEN`]; past that, `unknown`.
    #[cold]
    pub fn provisional(&self, labels: &CatalogLabels, model: &str) -> ModelIdx {
        let known = labels.of(model);
        if known != ModelIdx::UNKNOWN || model.len() > MAX_PROVISIONAL_LEN || model.is_empty() {
            return known;
        }
        let _grow = self.grow.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = self.interned.iter().position(|s| &*s.name == model) {
            return ModelIdx(i as u16);
        }
        if self.provisional.load(Relaxed) >= MAX_PROVISIONAL {
            return ModelIdx::UNKNOWN;
        }
        match self.interned.push(series(model.into())) {
            Some(i) => {
                self.provisional.fetch_add(1, Relaxed);
                ModelIdx(i as u16)
            }
            None => ModelIdx::UNKNOWN,
        }
    }

    /// Runs `f` on the series of model `m`.
    #[inline]
    pub fn with<R>(&self, m: ModelIdx, f: impl FnOnce(&ModelSeries) -> R) -> Option<R> {
        self.interned.get(m.0 as usize).map(f)
    }

    /// Every model ever labelled, `unknown` first.
    pub fn all(&self) -> impl Iterator<Item = &ModelSeries> {
        self.interned.iter()
    }

    /// The name of model `m`.
    pub fn name(&self, m: ModelIdx) -> &str {
        self.interned.get(m.0 as usize).map_or(UNKNOWN, |s| &s.name)
    }
}

/// Where `select` writes the model it read from a request's body, for `respond` to label the
/// request with. Only requests of a fleet that routes by model carry one (they already carry
/// their engines in the request's extensions); the others are labelled from the catalog alone.
#[derive(Debug, Clone, Default)]
pub struct ModelSlot(Arc<AtomicU16>);

impl ModelSlot {
    pub fn set(&self, m: ModelIdx) {
        self.0.store(m.0, Relaxed);
    }

    pub fn get(&self) -> ModelIdx {
        ModelIdx(self.0.load(Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::Model;

    fn catalog(lists: &[&[&str]]) -> Arc<Catalog> {
        Arc::new(Catalog::new(
            lists
                .iter()
                .map(|l| Some(l.iter().map(|id| Model::named(id)).collect()))
                .collect::<Vec<_>>(),
        ))
    }

    #[test]
    fn model_labels_follow_the_catalog_and_indices_are_never_reused() {
        let models = Models::default();
        let one = catalog(&[&["a"], &["a"]]);
        let l = models.labels(&one, 2);
        assert!(!l.by_model);
        let a = l.only;
        assert_ne!(a, ModelIdx::UNKNOWN);
        assert_eq!(l.of("a"), a);
        assert_eq!(l.of("zzz"), ModelIdx::UNKNOWN);
        drop(l);

        let two = catalog(&[&["b"], &["a"]]);
        let l = models.labels(&two, 2);
        assert!(l.by_model);
        assert_eq!(l.only, ModelIdx::UNKNOWN);
        assert_eq!(l.of("a"), a, "the same name keeps its index");
        let b = l.of("b");
        assert!(b != a && b != ModelIdx::UNKNOWN);
        assert_eq!(models.name(b), "b");
        assert_eq!(models.name(ModelIdx::UNKNOWN), UNKNOWN);
        assert_eq!(models.all().count(), 3);
        // The same catalog again: nothing resolved anew.
        let l2 = models.labels(&two, 2);
        assert!(Arc::ptr_eq(&l, &l2));
        drop((l, l2));
        // A model named `unknown` is the unknown one.
        let l = models.labels(&catalog(&[&["unknown", "c"]]), 1);
        assert_eq!(l.of(UNKNOWN), ModelIdx::UNKNOWN);
        assert_eq!(models.all().count(), 4);
    }
}
