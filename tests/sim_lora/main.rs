//! The simulated engine serving LoRA adapters as vLLM 0.32 does, over real sockets, checked
//! against what a real vLLM 0.32 answered (`tests/fixtures/vllm-0.32-lora/`, captured by
//! `bench/lora-facts.sh`).
//!
//! By part: [`serving`] (static adapters as models, each with its parent and its own text, the
//! 404 for one not served), [`runtime`] (load and unload, each answer as vLLM's), [`metrics`]
//! (`vllm:lora_requests_info`'s shape, waits set aside for a slot) and [`slots`] (more adapters
//! than slots: every request completes) and [`load`] (the load client spreading requests over
//! adapters; a scenario of them behind rankgate), over the helpers below.
#![cfg(feature = "sim")] // the simulated engine

#[path = "../common/mod.rs"]
mod common;
mod load;
mod metrics;
mod on_demand;
mod runtime;
mod serving;
mod slots;

use std::time::Duration;

use rankgate_sim::sim::lora::{LoraConfig, LoraModule};
use rankgate_sim::sim::{SimConfig, SimFlavor};
use serde_json::Value;

use common::{sim, Reply};

/// A vLLM engine of `dp` ranks serving `adapters` (each from the repository id `org/<name>`)
/// with `max_loras` slots per rank, runtime updating as asked, and a 1 ms slot load.
pub fn lora_engine(dp: u32, max_loras: u32, adapters: &[&str], runtime: bool) -> SimConfig {
    let modules = (adapters.iter())
        .map(|a| LoraModule {
            name: a.to_string(),
            path: format!("org/{a}"),
            base_model_name: None,
        })
        .collect();
    SimConfig {
        lora: Some(LoraConfig {
            max_loras,
            modules,
            runtime_updating: runtime,
            load_delay: Duration::from_millis(1),
            ..LoraConfig::default()
        }),
        ..sim(SimFlavor::Vllm, dp, 0)
    }
}

/// One exchange a real vLLM 0.32 answered: its status, its content type (`None`: it had none)
/// and its body.
pub struct Captured {
    pub status: u16,
    pub content_type: Option<String>,
    pub body: String,
}

/// The text of `tests/fixtures/vllm-0.32-lora/<name>.txt` (a scrape's `metrics-lora-*` as they
/// are).
pub fn fixture(name: &str) -> String {
    let path = format!(
        "{}/tests/fixtures/vllm-0.32-lora/{name}.txt",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The captured exchange `name`: a status line, a content-type line, a blank line and the body.
pub fn captured(name: &str) -> Captured {
    let path = name;
    let text = fixture(name);
    let mut lines = text.splitn(4, '\n');
    let status = lines.next().and_then(|l| l.split(' ').nth(1)).unwrap_or("");
    let ct = lines.next().and_then(|l| l.strip_prefix("content-type: "));
    lines.next();
    Captured {
        status: status.parse().unwrap_or_else(|_| panic!("{path}: status")),
        content_type: ct.filter(|c| *c != "None").map(str::to_string),
        body: lines
            .next()
            .unwrap_or("")
            .trim_end_matches('\n')
            .to_string(),
    }
}

/// Asserts `r` is the exchange captured as `name`: the same status, content type and body (as
/// JSON when it is JSON, else byte for byte).
pub fn assert_as_captured(r: &Reply, name: &str) {
    let c = captured(name);
    let body = String::from_utf8_lossy(&r.body);
    assert_eq!(r.status.as_u16(), c.status, "{name}: {body}");
    let ct = r.headers.get("content-type").map(|v| v.to_str().unwrap());
    assert_eq!(ct, c.content_type.as_deref(), "{name}: content type");
    match serde_json::from_str::<Value>(&c.body) {
        Ok(want) => assert_eq!(r.json(), want, "{name}"),
        Err(_) => assert_eq!(body, c.body, "{name}"),
    }
}

/// A chat request for `model` (max_tokens as given), its JSON body.
pub fn chat_for(model: &str, max_tokens: u64, stream: bool) -> Value {
    serde_json::json!({"model": model, "max_tokens": max_tokens, "stream": stream,
        "messages": [{"role": "user", "content": "say something"}]})
}

/// The assistant's text of a whole chat answer.
pub fn content(r: &Reply) -> String {
    let v = r.json();
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content: {v}"))
        .to_string()
}
