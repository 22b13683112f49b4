//! LoRA adapters as vLLM 0.32 serves them (`--enable-lora`, vLLM flavor only): each adapter is
//! a model of its own that `/v1/models` lists with its `parent` and `root`, that requests name
//! like any model, and whose answers differ from the base model's and from every other adapter's
//! ([`token`]); its prompts' KV blocks are its own in the prefix cache ([`salted`]).
//!
//! This module owns the engine's list of adapters (vLLM's `OpenAIServingModels.lora_requests`,
//! `vllm/entrypoints/openai/models/serving.py`): the static ones of `--lora-modules`, and with
//! runtime updating those `update` loads and unloads. Each gets an id as vLLM gives its
//! `lora_int_id` (a counter from 1; a reload in place keeps its id), which is what a rank's batch
//! and slots know it by: the scheduling rule (a request without a slot is set aside, not
//! blocking) and the slot loads are the rank's (`rank/waiting.rs`). `config` reads the settings,
//! `info` publishes `vllm:lora_requests_info` and the sim's own slot counters.

pub mod config;
mod info;
mod update;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use std::hash::{Hash, Hasher};

use serde_json::{json, Value};

use super::prefix::Blocks;
use super::{lock, Sim, SimEngine};
pub use config::{LoraConfig, LoraModule};

/// An adapter as a request carries it: its id (vLLM's `lora_int_id`) and its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Adapter {
    pub(crate) id: u32,
    pub(crate) name: Arc<str>,
}

/// One adapter the engine serves.
#[derive(Debug, Clone)]
struct Served {
    adapter: Adapter,
    path: String,
    /// The base model `/v1/models` names as its parent.
    parent: String,
}

/// The engine's adapters and what it publishes about them.
#[derive(Debug)]
pub(crate) struct Lora {
    pub(crate) cfg: LoraConfig,
    /// The base models' names: a parent must be one, and requests naming one are the base's.
    base: Vec<String>,
    /// Served adapters in load order, as `/v1/models` lists them (at most
    /// [`config::MAX_ADAPTERS`]).
    served: Mutex<Vec<Served>>,
    /// The last id given: vLLM's `lora_id_counter`.
    next_id: AtomicU32,
    info: Mutex<info::Info>,
    /// Runtime load requests received (`POST /v1/load_lora_adapter`), answered or not.
    load_requests: AtomicU64,
}

impl Lora {
    /// The engine's adapters at start: the static modules, in order, ids from 1. `cfg` was
    /// checked ([`LoraConfig::check`]).
    pub(crate) fn new(cfg: &LoraConfig, base: &[String]) -> Lora {
        let lora = Lora {
            cfg: cfg.clone(),
            base: base.to_vec(),
            served: Mutex::new(Vec::new()),
            next_id: AtomicU32::new(0),
            info: Mutex::default(),
            load_requests: AtomicU64::new(0),
        };
        for m in &cfg.modules {
            lora.add(&m.name, &m.path, m.base_model_name.as_deref(), false);
        }
        lora
    }

    /// Serves `name` from `path`: a new adapter with the next id, or, `in_place`, the one of that
    /// name reloaded with its id kept.
    fn add(&self, name: &str, path: &str, base_model: Option<&str>, in_place: bool) {
        // vLLM names the requested base model when it is one of its own, else its first.
        let parent = (base_model.filter(|b| self.base.iter().any(|m| m == b)))
            .or(self.base.first().map(String::as_str))
            .unwrap_or(super::DEFAULT_MODEL)
            .to_string();
        let mut served = lock(&self.served);
        let old = served.iter().position(|s| *s.adapter.name == *name);
        let id = match old.filter(|_| in_place) {
            Some(i) => served[i].adapter.id,
            None => self.next_id.fetch_add(1, Relaxed) + 1,
        };
        let entry = Served {
            adapter: Adapter {
                id,
                name: name.into(),
            },
            path: path.to_string(),
            parent,
        };
        match old {
            Some(i) => served[i] = entry,
            None => served.push(entry),
        }
    }

    /// The adapter named `name`, when served.
    fn find(&self, name: &str) -> Option<Adapter> {
        (lock(&self.served).iter())
            .find(|s| *s.adapter.name == *name)
            .map(|s| s.adapter.clone())
    }
}

/// The text of an answer's token `i`: the base model's, or one of the adapter's own, so that an
/// answer shows which adapter wrote it (each adapter's text differs from the base's and from
/// every other adapter's, as the real ones' do on the same prompt).
pub(crate) fn token(adapter: Option<&Adapter>, i: u64) -> String {
    match adapter {
        None => format!("t{} ", i % 10),
        Some(a) => format!("{}:t{} ", a.name, i % 10),
    }
}

/// A prompt's (or a finished answer's) KV blocks as an adapter's: vLLM hashes the adapter into
/// every block's key (its "extra keys"), so the same tokens under another adapter, or under the
/// base model, are other blocks and never a prefix-cache hit. The base model's are unchanged.
pub(crate) fn salted(blocks: Option<Blocks>, adapter: Option<&Adapter>) -> Option<Blocks> {
    match (blocks, adapter) {
        (Some(mut b), Some(a)) => {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            ("lora", &*a.name).hash(&mut h);
            let salt = h.finish();
            // The same salt on every id keeps the chain: one adapter's equal prefixes share.
            b.ids.iter_mut().for_each(|id| *id ^= salt);
            Some(b)
        }
        (blocks, _) => blocks,
    }
}

impl Sim {
    /// The adapter a request's `model` names, when the engine serves one by that name (a base
    /// model's name is the base model's, as vLLM checks base models first).
    pub(crate) fn adapter(&self, model: &str) -> Option<Adapter> {
        self.lora.as_ref()?.find(model)
    }

    /// The 404 message for a model the engine does not serve. vLLM 0.32 with LoRA on adds the
    /// served names (`tests/fixtures/vllm-0.32-lora/chat-chat-lora-before-load.txt`: the base
    /// names, not the adapters); without LoRA the sim keeps the message its other tests know.
    pub(crate) fn unknown_model(&self, name: &str) -> String {
        match &self.lora {
            Some(_) => format!(
                "The model `{name}` does not exist. Valid aliases: {}.",
                self.cfg.models.join(", ")
            ),
            None => format!("The model `{name}` does not exist."),
        }
    }

    /// The adapters' `/v1/models` cards, listed after the base models as vLLM lists them.
    pub(crate) fn adapter_cards(&self) -> Vec<Value> {
        let Some(lora) = &self.lora else {
            return Vec::new();
        };
        (lock(&lora.served).iter())
            .map(|s| {
                json!({"id": &*s.adapter.name, "object": "model", "created": 0,
                    "owned_by": self.cfg.flavor.as_str(), "root": s.path, "parent": s.parent,
                    "max_model_len": null})
            })
            .collect()
    }

    /// Waits while local rank `local`'s steps are stalled by adapter loads: a step runs only
    /// once the adapters its batch needs are in their slots.
    pub(crate) async fn lora_stall(&self, local: usize) {
        if self.lora.is_none() {
            return;
        }
        let until = self.ranks.get(local).and_then(|r| r.lora_stall_until());
        if let Some(t) = until.filter(|t| *t > tokio::time::Instant::now()) {
            tokio::time::sleep_until(t).await;
        }
    }

    /// A generation starts running (with LoRA on): the gauge knows it until the guard drops.
    pub(crate) fn lora_running(&self, adapter: Option<&Adapter>) -> Option<Running<'_>> {
        let lora = self.lora.as_ref()?;
        let name = adapter.map(|a| a.name.clone());
        lock(&lora.info).start(name.as_ref());
        Some(Running { lora, name })
    }
}

/// A generation the gauge counts as running until it is dropped.
pub(crate) struct Running<'a> {
    lora: &'a Lora,
    name: Option<Arc<str>>,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        lock(&self.lora.info).finish(self.name.as_ref());
    }
}

impl super::SimConfig {
    /// What is wrong with the LoRA settings, if anything: adapters are vLLM's here (the SGLang
    /// flavor has none), and the settings must be ones vLLM would start with.
    pub fn check_lora(&self) -> Result<(), String> {
        let Some(l) = &self.lora else { return Ok(()) };
        if self.flavor != super::SimFlavor::Vllm {
            return Err("LoRA adapters are simulated for the vLLM flavor only".into());
        }
        l.check(&self.models)
    }
}

impl SimEngine {
    /// Per local rank: requests set aside for want of a LoRA slot (each counted once), what
    /// `sim_lora_slot_waits_total` says. Empty without LoRA.
    pub fn lora_slot_waits(&self) -> Vec<u64> {
        self.lora_counts(|c| c.waits)
    }

    /// Per local rank: adapters loaded into a slot (`sim_lora_loads_total`). Empty without LoRA.
    pub fn lora_loads(&self) -> Vec<u64> {
        self.lora_counts(|c| c.loads)
    }

    fn lora_counts(&self, f: impl Fn(super::rank::SlotCounts) -> u64) -> Vec<u64> {
        match self.sim.lora {
            Some(_) => (self.sim.ranks.iter())
                .map(|r| f(r.counts().lora))
                .collect(),
            None => Vec::new(),
        }
    }

    /// Runtime load requests received (`POST /v1/load_lora_adapter`), answered or not.
    pub fn lora_load_requests(&self) -> u64 {
        (self.sim.lora.iter())
            .map(|l| l.load_requests.load(Relaxed))
            .sum()
    }

    /// The adapters the engine serves now, in load order.
    pub fn adapters(&self) -> Vec<String> {
        (self.sim.lora.iter())
            .flat_map(|l| {
                lock(&l.served)
                    .iter()
                    .map(|s| s.adapter.name.to_string())
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_count_up_and_a_reload_in_place_keeps_its_id() {
        let cfg = LoraConfig {
            modules: vec![
                LoraModule::parse("a=org/a").unwrap(),
                LoraModule::parse(r#"{"name": "b", "path": "org/b", "base_model_name": "x"}"#)
                    .unwrap(),
            ],
            ..LoraConfig::default()
        };
        let lora = Lora::new(&cfg, &["base".to_string()]);
        assert_eq!(lora.find("a").map(|a| a.id), Some(1));
        let served = lock(&lora.served).clone();
        assert_eq!(served[1].parent, "base", "not a served name: the first one");
        lora.add("c", "org/c", None, false);
        lora.add("a", "org/a2", None, true);
        assert_eq!(lora.find("c").map(|a| a.id), Some(3));
        assert_eq!(lora.find("a").map(|a| a.id), Some(1), "in place");
        assert_eq!(lock(&lora.served)[0].path, "org/a2");
    }

    #[test]
    fn an_adapters_blocks_are_its_own_and_the_base_models_unchanged() {
        let blocks = Blocks::of_tokens(&[7; 48]);
        let a = |name: &str| Adapter {
            id: 1,
            name: name.into(),
        };
        let ids = |x: Option<&Adapter>| salted(Some(blocks.clone()), x).unwrap().ids;
        assert_eq!(ids(None), blocks.ids);
        assert_eq!(ids(Some(&a("x"))), ids(Some(&a("x"))));
        assert_ne!(ids(Some(&a("x"))), ids(Some(&a("y"))));
        assert!(ids(Some(&a("x"))).iter().all(|i| !blocks.ids.contains(i)));
        assert!(salted(None, Some(&a("x"))).is_none());
    }

    #[test]
    fn each_adapter_writes_its_own_text() {
        let a = Adapter {
            id: 1,
            name: "sql-lora".into(),
        };
        let b = Adapter {
            id: 2,
            name: "chat-lora".into(),
        };
        let texts: Vec<String> = [None, Some(&a), Some(&b)]
            .into_iter()
            .map(|x| (0..4).map(|i| token(x, i)).collect())
            .collect();
        assert_eq!(texts[0], "t0 t1 t2 t3 ");
        assert!(texts[1].starts_with("sql-lora:t0 "));
        assert!(texts[0] != texts[1] && texts[1] != texts[2] && texts[0] != texts[2]);
    }
}
