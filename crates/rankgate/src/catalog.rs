//! What the fleet serves: each engine's models (fixed in its config, else as its `/v1/models`
//! last said) and, the other way round, which engines serve a model; and the names clients may
//! send instead (`[[routes]]`, [`crate::model_routes`]), so that a reload swaps both in one
//! snapshot. Part of the snapshot, and rebuilt only when a model list or the routes change.

use crate::ix::{EngineIx, IxVec};
use crate::model_routes::Routes;
use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{json, Value};

/// One model an engine serves, with the engine's own `/v1/models` entry for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    pub id: String,
    pub entry: Value,
}

impl Model {
    /// A model named in the config: its entry says only what rankgate knows.
    pub fn named(id: &str) -> Model {
        Model {
            id: id.to_string(),
            entry: json!({"id": id, "object": "model", "created": 0, "owned_by": "rankgate"}),
        }
    }
}

/// Why a request's model cannot be served.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    #[error("the model `{model}` does not exist; this fleet serves: {}", .served.join(", "))]
    NotFound { model: String, served: Vec<String> },
    #[error("the request names no model and this fleet serves several: {}", .0.join(", "))]
    Missing(Vec<String>),
    /// A route's target no engine serves (the route itself is known: `[[routes]]`).
    #[error("the model `{route}` is a route to `{target}`, which this fleet does not serve; it serves: {}", .served.join(", "))]
    RouteTarget {
        route: String,
        target: String,
        served: Vec<String>,
    },
}

/// A client's model name as an error message repeats it: at most 200 characters.
pub fn shown(model: &str) -> String {
    match model.char_indices().nth(200) {
        Some((cut, _)) => format!("{}...", &model[..cut]),
        None => model.to_string(),
    }
}

/// The fleet's models.
#[derive(Debug, Default, Clone)]
pub struct Catalog {
    /// Per engine: its models, `None` until known.
    engines: IxVec<EngineIx, Option<Arc<[Model]>>>,
    /// Every model some engine serves, in id order, with the engines serving it.
    models: BTreeMap<String, Vec<EngineIx>>,
    /// Every engine's list is known (read once here: requests ask for it).
    all_known: bool,
    /// `[[routes]]`: names a request's model may be rewritten from.
    routes: Arc<Routes>,
    /// Requests' bodies are read whole for their model: it decides the engines
    /// ([`Catalog::routes_by_model`]), or may name a route.
    reads_model: bool,
    /// The models that are LoRA adapters (their entry names a `parent`), each name shared by
    /// the requests for it.
    adapters: BTreeMap<String, Arc<str>>,
}

impl Catalog {
    /// `lists[e]` is engine `e`'s model list, if known.
    pub fn new(lists: impl Into<IxVec<EngineIx, Option<Arc<[Model]>>>>) -> Catalog {
        let lists = lists.into();
        let mut models: BTreeMap<String, Vec<EngineIx>> = BTreeMap::new();
        let mut adapters = BTreeMap::new();
        for (e, list) in lists.iter_enumerated() {
            for m in list.iter().flat_map(|l| l.iter()) {
                if m.entry
                    .get("parent")
                    .is_some_and(serde_json::Value::is_string)
                {
                    adapters.insert(m.id.clone(), m.id.as_str().into());
                }
                let engines = models.entry(m.id.clone()).or_default();
                if engines.last() != Some(&e) {
                    engines.push(e);
                }
            }
        }
        let mut catalog = Catalog {
            all_known: lists.iter().all(Option::is_some),
            engines: lists,
            models,
            routes: Arc::default(),
            reads_model: false,
            adapters,
        };
        catalog.reads_model = catalog.routes_by_model();
        catalog
    }

    /// The same catalog with these routes.
    pub fn routed(self, routes: Arc<Routes>) -> Catalog {
        // A declared adapter no list names is found by reading the model too.
        let reads_model =
            self.routes_by_model() || !routes.is_empty() || !routes.adapters().is_empty();
        Catalog {
            routes,
            reads_model,
            ..self
        }
    }

    /// The same catalog with `routes` in place of its own, when they differ (each target that
    /// stays counting on from its count here); `None` when they do not.
    pub fn rerouted(&self, routes: &Routes) -> Option<Catalog> {
        if *routes == *self.routes {
            return None;
        }
        tracing::info!(routes = routes.iter().count(), "model routes changed");
        Some(self.clone().routed(Arc::new(routes.carry(&self.routes))))
    }

    /// The same catalog with engine `e`'s list replaced.
    pub fn with(&self, e: EngineIx, list: Arc<[Model]>) -> Catalog {
        let mut lists = self.engines.clone();
        if let Some(slot) = lists.get_mut(e) {
            *slot = Some(list);
        }
        Catalog::new(lists).routed(self.routes.clone())
    }

    /// `[[routes]]`: empty unless the config has some.
    #[inline]
    pub fn routes(&self) -> &Arc<Routes> {
        &self.routes
    }

    /// Whether a request's body is read whole for its model: it decides the engines, or may
    /// name a route.
    #[inline]
    pub fn reads_model(&self) -> bool {
        self.reads_model
    }

    /// Engine `e`'s models, if known.
    pub fn of(&self, e: EngineIx) -> Option<&[Model]> {
        self.engines.get(e)?.as_deref()
    }

    /// `model`'s name, when it is a LoRA adapter of some engine (its `/v1/models` entry names a
    /// `parent`).
    pub fn adapter(&self, model: &str) -> Option<&Arc<str>> {
        self.adapters.get(model)
    }

    /// Whether some engine's known model list has `model`.
    pub fn listed(&self, model: &str) -> bool {
        self.models.contains_key(model)
    }

    pub fn serves(&self, e: EngineIx, model: &str) -> bool {
        self.of(e).is_some_and(|l| l.iter().any(|m| m.id == model))
    }

    /// Whether a request's model decides where it may go: the fleet serves several models, or
    /// one while some engine's list is still unknown (it may serve another). With one model
    /// everywhere, or nothing known at all, any rank will do (the body is only checked for a
    /// model the fleet does not serve: [`Catalog::sole_model`]).
    pub fn routes_by_model(&self) -> bool {
        self.models.len() > 1 || (self.models.len() == 1 && !self.all_known)
    }

    /// Some engine's model list is not known yet (its `/v1/models` not read).
    pub fn lists_pending(&self) -> bool {
        !self.all_known
    }

    /// The one model of a fleet that serves one, once every engine's list is known: a request
    /// naming another is answered here (no engine serves it). `None` while some list is unknown
    /// (that engine may serve any model).
    pub fn sole_model(&self) -> Option<&str> {
        match (self.all_known, self.models.len()) {
            (true, 1) => self.models.keys().next().map(String::as_str),
            _ => None,
        }
    }

    /// Among the engines `allowed` (those serving the request's route), the ones that may serve
    /// a request for `model`, in engine order: those whose list has it, or, when no allowed
    /// engine's known list has it, the allowed ones whose list is unknown. A request naming no
    /// model may go to any of them as long as they serve one model between them. `Err` when no
    /// engine can.
    pub fn engines_for(
        &self,
        model: Option<&str>,
        allowed: impl Fn(EngineIx) -> bool,
    ) -> Result<Vec<EngineIx>, ModelError> {
        let served = || self.models.keys().cloned().collect::<Vec<_>>();
        let Some(model) = model else {
            let engines: Vec<EngineIx> = self.engines.indices().filter(|&e| allowed(e)).collect();
            let mut theirs: Vec<&str> = engines
                .iter()
                .flat_map(|&e| self.of(e).into_iter().flatten())
                .map(|m| m.id.as_str())
                .collect();
            theirs.sort_unstable();
            theirs.dedup();
            return match theirs.len() {
                0 | 1 => Ok(engines),
                _ => Err(ModelError::Missing(
                    theirs.into_iter().map(str::to_string).collect(),
                )),
            };
        };
        let known = self.models.get(model);
        if let Some(engines) = known {
            let known: Vec<EngineIx> = engines.iter().copied().filter(|&e| allowed(e)).collect();
            if !known.is_empty() {
                return Ok(known);
            }
        }
        // No engine known to serve it serves this route: one whose list is still unknown (it
        // just started) may, so it is tried rather than answering 404.
        let unknown: Vec<EngineIx> = (self.engines.indices())
            .filter(|&e| self.engines[e].is_none() && allowed(e))
            .collect();
        if unknown.is_empty() && known.is_none() {
            return Err(ModelError::NotFound {
                model: shown(model),
                served: served(),
            });
        }
        Ok(unknown)
    }

    /// The fleet's `/v1/models`: each model once, from the engines `listed` allows (those
    /// with fresh telemetry), in id order; the first such engine's entry stands for it. Each
    /// route is listed too, served or not (its entry names its targets), in place of a model
    /// of its name: a request naming it goes to a target; and each adapter `[[adapters]]`
    /// declares that no engine lists yet (a request naming it loads it), with its parent.
    pub fn listing(&self, listed: impl Fn(EngineIx) -> bool) -> Value {
        let declared: Vec<Value> = (self.routes.adapters().iter())
            .filter(|a| !self.models.contains_key(&*a.name))
            .map(|a| {
                json!({"id": &*a.name, "object": "model", "created": 0, "owned_by": "rankgate",
                    "parent": &*a.base})
            })
            .collect();
        let mut data: Vec<&Value> = self
            .models
            .iter()
            .filter(|(id, _)| self.routes.get(id).is_none())
            .filter_map(|(id, engines)| {
                let e = *engines.iter().find(|&&e| listed(e))?;
                self.of(e)?.iter().find(|m| &m.id == id).map(|m| &m.entry)
            })
            .collect();
        if !self.routes.is_empty() || !declared.is_empty() {
            data.extend(self.routes.iter().map(|r| r.entry()));
            data.extend(&declared);
            data.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
        }
        json!({"object": "list", "data": data})
    }

    /// One model's entry, if a listed engine serves it, or a route's.
    pub fn entry(&self, id: &str, listed: impl Fn(EngineIx) -> bool) -> Option<&Value> {
        if let Some(route) = self.routes.get(id) {
            return Some(route.entry());
        }
        let e = *self.models.get(id)?.iter().find(|&&e| listed(e))?;
        self.of(e)?.iter().find(|m| m.id == id).map(|m| &m.entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ix::Ix;

    fn ix(e: usize) -> EngineIx {
        EngineIx::new(e)
    }

    fn ixs(es: &[usize]) -> Vec<EngineIx> {
        es.iter().map(|&e| ix(e)).collect()
    }

    fn list(ids: &[&str]) -> Option<Arc<[Model]>> {
        Some(ids.iter().map(|id| Model::named(id)).collect())
    }

    #[test]
    fn a_model_goes_to_the_engines_that_serve_it() {
        let c = Catalog::new(vec![list(&["a"]), list(&["b", "a"]), list(&["b"])]);
        assert!(c.routes_by_model());
        assert_eq!(c.engines_for(Some("a"), |_| true), Ok(ixs(&[0, 1])));
        assert_eq!(c.engines_for(Some("b"), |_| true), Ok(ixs(&[1, 2])));
        let e = c.engines_for(Some("c"), |_| true).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the model `c` does not exist; this fleet serves: a, b"
        );
        assert!(matches!(
            c.engines_for(None, |_| true),
            Err(ModelError::Missing(_))
        ));
        // Only engine 2 serves the route: its one model needs no naming.
        assert_eq!(c.engines_for(None, |e| e == ix(2)), Ok(ixs(&[2])));
        assert_eq!(c.engines_for(Some("a"), |e| e != ix(0)), Ok(ixs(&[1])));
    }

    #[test]
    fn one_model_everywhere_needs_no_scan_and_no_model() {
        let c = Catalog::new(vec![list(&["a"]), list(&["a"])]);
        assert!(!c.routes_by_model());
        assert_eq!(c.engines_for(None, |_| true), Ok(ixs(&[0, 1])));
        assert!(!Catalog::new(vec![None, None]).routes_by_model());
    }

    #[test]
    fn an_engine_whose_list_is_unknown_may_serve_what_no_known_list_has() {
        let c = Catalog::new(vec![list(&["a"]), None]);
        assert!(
            c.routes_by_model(),
            "the unknown engine may serve another model"
        );
        assert_eq!(c.engines_for(Some("a"), |_| true), Ok(ixs(&[0])));
        assert_eq!(c.engines_for(Some("z"), |_| true), Ok(ixs(&[1])));
        // Only the unknown engine serves the route: it may serve `a` too.
        assert_eq!(c.engines_for(Some("a"), |e| e == ix(1)), Ok(ixs(&[1])));
        // A route only engines that do not serve `a` serve: none, though `a` exists.
        let c = Catalog::new(vec![list(&["a"]), list(&["b"])]);
        assert_eq!(c.engines_for(Some("a"), |e| e == ix(1)), Ok(ixs(&[])));
    }

    #[test]
    fn the_listing_has_each_model_once_from_listed_engines_only() {
        let c = Catalog::new(vec![list(&["b", "a"]), list(&["a"]), list(&["c"])]);
        let v = c.listing(|e| e != ix(2));
        let ids: Vec<&str> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["a", "b"]);
        assert!(c.entry("c", |e| e != ix(2)).is_none());
        assert_eq!(c.entry("a", |_| true).unwrap()["id"], "a");
    }

    #[test]
    fn routes_are_listed_whether_served_or_not_and_keep_the_model_read() {
        use crate::model_routes::{Route, Routes};
        let c = Catalog::new(vec![list(&["a"])]);
        assert!(!c.reads_model(), "one model: bodies are not read");
        let routes = Routes::new(vec![
            Route::new("chat", vec![("a".into(), 9), ("new".into(), 1)], None),
            Route::new("b", vec![("a".into(), 1)], None),
        ]);
        let c = c.routed(Arc::new(routes));
        assert!(c.reads_model() && !c.routes_by_model());
        let v = c.listing(|_| true);
        let ids: Vec<&str> = (v["data"].as_array().unwrap().iter())
            .map(|m| m["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["a", "b", "chat"]);
        let chat = c.entry("chat", |_| false).unwrap();
        assert_eq!(chat["owned_by"], "rankgate");
        assert_eq!(chat["targets"][1], json!({"model": "new", "weight": 1}));
        // A list that changes keeps the routes.
        let c = c.with(ix(0), list(&["a", "z"]).unwrap());
        assert!(c.routes().get("chat").is_some() && c.reads_model());
    }
}
