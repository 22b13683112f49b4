//! What the fleet serves: each engine's models (fixed in its config, else as its `/v1/models`
//! last said) and, the other way round, which engines serve a model. Part of the snapshot, and
//! rebuilt only when a model list changes.

use crate::ix::{EngineIx, IxVec};
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
}

/// A client's model name as an error message repeats it: at most 200 characters.
pub fn shown(model: &str) -> String {
    match model.char_indices().nth(200) {
        Some((cut, _)) => format!("{}...", &model[..cut]),
        None => model.to_string(),
    }
}

/// The fleet's models.
#[derive(Debug, Default)]
pub struct Catalog {
    /// Per engine: its models, `None` until known.
    engines: IxVec<EngineIx, Option<Arc<[Model]>>>,
    /// Every model some engine serves, in id order, with the engines serving it.
    models: BTreeMap<String, Vec<EngineIx>>,
    /// Every engine's list is known (read once here: requests ask for it).
    all_known: bool,
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
        Catalog {
            all_known: lists.iter().all(Option::is_some),
            engines: lists,
            models,
            adapters,
        }
    }

    /// The same catalog with engine `e`'s list replaced.
    pub fn with(&self, e: EngineIx, list: Arc<[Model]>) -> Catalog {
        let mut lists = self.engines.clone();
        if let Some(slot) = lists.get_mut(e) {
            *slot = Some(list);
        }
        Catalog::new(lists)
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
    /// with fresh telemetry), in id order; the first such engine's entry stands for it.
    pub fn listing(&self, listed: impl Fn(EngineIx) -> bool) -> Value {
        let data: Vec<&Value> = self
            .models
            .iter()
            .filter_map(|(id, engines)| {
                let e = *engines.iter().find(|&&e| listed(e))?;
                self.of(e)?.iter().find(|m| &m.id == id).map(|m| &m.entry)
            })
            .collect();
        json!({"object": "list", "data": data})
    }

    /// One model's entry, if a listed engine serves it.
    pub fn entry(&self, id: &str, listed: impl Fn(EngineIx) -> bool) -> Option<&Value> {
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
}
