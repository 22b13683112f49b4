//! The LoRA settings of a simulated vLLM engine, read as vLLM reads them: `--enable-lora`,
//! `--max-loras`, `--max-lora-rank`, `--lora-modules` (each `name=path` or vLLM's JSON form) and
//! runtime updating (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`), plus the one figure vLLM has no flag
//! for: how long loading an adapter into a rank's slot holds that rank's step.
//!
//! Defaults are vLLM's (`vllm/config/lora.py`, `LoRAConfig`): `max_loras` 1, `max_lora_rank` 16
//! out of `MaxLoRARanks`. The sim has no adapter weights, so "an adapter at `path`" is a promise:
//! a path written as a local one (`/`, `./`, `../`, `~`) must be a directory, as vLLM's loader
//! needs its files; anything else is taken as a Hugging Face repository id, which vLLM would
//! download and the sim takes as found ([`found`]).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

/// vLLM's default `--max-loras`: one distinct adapter per batch.
pub const DEFAULT_MAX_LORAS: u32 = 1;
/// vLLM's default `--max-lora-rank`.
pub const DEFAULT_MAX_LORA_RANK: u32 = 16;
/// The ranks vLLM's `--max-lora-rank` accepts (`MaxLoRARanks`).
pub const LORA_RANKS: [u32; 9] = [1, 8, 16, 32, 64, 128, 256, 320, 512];
/// Loading an adapter into a rank's slot, by default. A rank-16 adapter of an 8B Llama (all
/// projections) is about 80 MB of bf16 weights: read from the page cache and copied to the GPU
/// in a few tens of milliseconds, the stall vLLM's worker adds to the step that first runs it.
pub const DEFAULT_LOAD: Duration = Duration::from_millis(25);
/// Adapters one engine serves at most, static and loaded at runtime together. vLLM has no
/// bound but memory; the sim's list, the `/v1/models` answer and the gauge's labels stay small.
pub const MAX_ADAPTERS: usize = 256;
/// The longest adapter name the sim accepts (it becomes a model name and a metric label).
pub const MAX_NAME_BYTES: usize = 256;
/// The longest adapter path the sim accepts.
pub const MAX_PATH_BYTES: usize = 4096;
/// The slot load the sim accepts at most: a stall longer than this is a typo, not a disk.
pub const MAX_LOAD: Duration = Duration::from_secs(60);

/// One adapter of `--lora-modules`: vLLM's `LoRAModulePath`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraModule {
    pub name: String,
    pub path: String,
    /// The base model `/v1/models` names as its `parent`; absent (or not a served name), the
    /// first served name, as vLLM lists it.
    #[serde(default)]
    pub base_model_name: Option<String>,
}

impl LoraModule {
    /// One `--lora-modules` value as vLLM's `LoRAParserAction` reads it: `name=path` when it
    /// has an `=` and no `,`, else a JSON object `{"name", "path", "base_model_name"?}`.
    pub fn parse(item: &str) -> Result<LoraModule, String> {
        let m = match item.split_once('=') {
            Some((name, path)) if !item.contains(',') && !path.contains('=') => LoraModule {
                name: name.to_string(),
                path: path.to_string(),
                base_model_name: None,
            },
            _ => serde_json::from_str(item)
                .map_err(|e| format!("--lora-modules {item:?}: not name=path nor JSON: {e}"))?,
        };
        check_name(&m.name).map_err(|e| format!("--lora-modules {item:?}: {e}"))?;
        check_path(&m.path).map_err(|e| format!("--lora-modules {item:?}: {e}"))?;
        Ok(m)
    }
}

/// What is wrong with an adapter name, if anything.
pub(crate) fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(format!("an adapter name takes 1 to {MAX_NAME_BYTES} bytes"));
    }
    // It becomes a label value and one entry of a comma-separated label.
    if name.contains([',', '"', '\\', '\n']) {
        return Err(format!(
            "adapter name {name:?}: no commas, quotes, backslashes or newlines"
        ));
    }
    Ok(())
}

/// What is wrong with an adapter path, if anything (whether it is found is [`found`]'s).
pub(crate) fn check_path(path: &str) -> Result<(), String> {
    if path.is_empty() || path.len() > MAX_PATH_BYTES {
        return Err(format!("an adapter path takes 1 to {MAX_PATH_BYTES} bytes"));
    }
    Ok(())
}

/// Whether an adapter is found at `path`: a local path (`/`, `./`, `../`, `~`) must be a
/// directory, as vLLM reads the adapter's files from it; anything else is a Hugging Face
/// repository id, which vLLM would download and the sim, offline, takes as found.
pub(crate) fn found(path: &str) -> bool {
    let local = match path.strip_prefix('~') {
        Some(rest) => {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(rest.trim_start_matches('/')))
        }
        None if path.starts_with('/') || path.starts_with("./") || path.starts_with("../") => {
            Some(PathBuf::from(path))
        }
        None => None,
    };
    match local {
        Some(p) => p.is_dir(),
        None => true,
    }
}

/// Whether `VLLM_ALLOW_RUNTIME_LORA_UPDATING` says yes, as vLLM's `envs.py` reads it: `1` or
/// `true` in any case, spaces around ignored.
pub fn runtime_updating_env(value: Option<&str>) -> bool {
    value.is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true"))
}

/// `--enable-lora` and the settings that go with it.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// `--max-loras`: distinct adapters one rank's batch runs at once; a waiting request for
    /// another adapter is skipped (not blocked) until one of them has no running request.
    pub max_loras: u32,
    /// `--max-lora-rank`: accepted and checked against vLLM's choices; it costs nothing here.
    pub max_lora_rank: u32,
    /// `--lora-modules`: the adapters served from the start, each listed by `/v1/models`.
    pub modules: Vec<LoraModule>,
    /// `VLLM_ALLOW_RUNTIME_LORA_UPDATING`: `POST /v1/load_lora_adapter` and
    /// `/v1/unload_lora_adapter` exist; off, they are unknown routes (404).
    pub runtime_updating: bool,
    /// How long loading an adapter into a rank's slot stalls that rank's step (the sim's
    /// `--lora-load-ms`): paid once per load, again only after the adapter was evicted.
    pub load_delay: Duration,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            max_loras: DEFAULT_MAX_LORAS,
            max_lora_rank: DEFAULT_MAX_LORA_RANK,
            modules: Vec::new(),
            runtime_updating: false,
            load_delay: DEFAULT_LOAD,
        }
    }
}

impl LoraConfig {
    /// What is wrong with the settings for an engine serving `base` models, if anything; a
    /// static adapter whose local path is not there fails as vLLM fails to start.
    pub fn check(&self, base: &[String]) -> Result<(), String> {
        if self.max_loras == 0 {
            return Err("max_loras must be at least 1".into());
        }
        if !LORA_RANKS.contains(&self.max_lora_rank) {
            return Err(format!(
                "max_lora_rank {} is not one of vLLM's {LORA_RANKS:?}",
                self.max_lora_rank
            ));
        }
        if self.load_delay > MAX_LOAD {
            return Err(format!(
                "the LoRA load time {:?} is past {MAX_LOAD:?}",
                self.load_delay
            ));
        }
        if self.modules.len() > MAX_ADAPTERS {
            return Err(format!(
                "{} LoRA modules: an engine serves at most {MAX_ADAPTERS}",
                self.modules.len()
            ));
        }
        let mut names = std::collections::BTreeSet::new();
        for m in &self.modules {
            check_name(&m.name)?;
            check_path(&m.path)?;
            if base.contains(&m.name) {
                return Err(format!(
                    "LoRA module {:?} has the name of a served model",
                    m.name
                ));
            }
            if !names.insert(m.name.as_str()) {
                return Err(format!("LoRA module {:?} is named twice", m.name));
            }
            if !found(&m.path) {
                return Err(not_found(&m.name, &m.path));
            }
        }
        Ok(())
    }
}

/// vLLM's `LoRAAdapterNotFoundError` message (`vllm/exceptions.py`).
pub(crate) fn not_found(name: &str, path: &str) -> String {
    format!("Loading lora {name} failed: No adapter found for {path}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_read_as_vllm_reads_them() {
        let m = LoraModule::parse("sql-lora=/tmp").unwrap();
        assert_eq!((m.name.as_str(), m.path.as_str()), ("sql-lora", "/tmp"));
        let j =
            LoraModule::parse(r#"{"name": "a", "path": "org/a", "base_model_name": "b"}"#).unwrap();
        assert_eq!(j.base_model_name.as_deref(), Some("b"));
        for bad in ["nothing", "a=b=c", r#"{"name": "a"}"#, "=x", "a,b=c", "a="] {
            assert!(LoraModule::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn settings_are_checked_like_vllms() {
        let base = vec!["tiny-llama".to_string()];
        let ok = LoraConfig {
            modules: vec![LoraModule::parse("a=org/a").unwrap()],
            ..LoraConfig::default()
        };
        ok.check(&base).unwrap();
        let bad = |c: LoraConfig, says: &str| {
            let e = c.check(&base).unwrap_err();
            assert!(e.contains(says), "{e}");
        };
        bad(
            LoraConfig {
                max_loras: 0,
                ..ok.clone()
            },
            "max_loras",
        );
        bad(
            LoraConfig {
                max_lora_rank: 12,
                ..ok.clone()
            },
            "max_lora_rank 12",
        );
        let twice = LoraConfig {
            modules: vec![ok.modules[0].clone(), ok.modules[0].clone()],
            ..ok.clone()
        };
        bad(twice, "named twice");
        let gone = LoraConfig {
            modules: vec![LoraModule::parse("g=/nonexistent/lora").unwrap()],
            ..ok.clone()
        };
        bad(gone, "No adapter found for /nonexistent/lora");
        let clash = LoraConfig {
            modules: vec![LoraModule::parse("tiny-llama=org/x").unwrap()],
            ..ok.clone()
        };
        bad(clash, "served model");
    }

    #[test]
    fn the_env_var_is_read_as_vllm_reads_it() {
        for (v, want) in [
            (Some("True"), true),
            (Some(" 1 "), true),
            (Some("yes"), false),
            (Some("0"), false),
            (None, false),
        ] {
            assert_eq!(runtime_updating_env(v), want, "{v:?}");
        }
    }

    #[test]
    fn local_paths_must_exist_and_repository_ids_are_found() {
        assert!(found("/"));
        assert!(!found("/nonexistent/lora"));
        assert!(!found("./surely/not/here"));
        assert!(found("org/some-lora"));
    }
}
