//! The simulated engine's model files: the tokenizer and chat template of the tiny model the
//! real vLLM capture was made with (`tests/fixtures/vllm-0.32-kv-events/`), shipped in
//! [`SHIPPED_DIR`] for a router's `[[models]]` to point at, and built into the binary from there,
//! so that a simulated engine publishing KV events names its blocks by the same token ids a
//! router computes for the same request: `rankgate demo`, the scenarios and `rankgate
//! mock-engine` need no files beside the binary. [`tiny_model_dir`] writes them out once (a
//! router's `[[models]]` reads a directory); [`tokenizer`] makes the engine's side of the seam
//! from any model directory.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use rankgate::tokenize::ChatTokenizer;

use super::SimTokenizer;

/// Where the repository ships the tiny model's tokenizer files (relative to its root): the
/// bytes [`FILES`] holds, for a router's `[[models]] tokenizer`.
pub const SHIPPED_DIR: &str = "configs/tokenizers/tiny-llama";

/// The files of the tiny model, by name (one copy: the shipped ones).
const FILES: [(&str, &[u8]); 3] = [
    (
        "tokenizer.json",
        include_bytes!("../../../../configs/tokenizers/tiny-llama/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../../../../configs/tokenizers/tiny-llama/tokenizer_config.json"),
    ),
    (
        "chat_template.jinja",
        include_bytes!("../../../../configs/tokenizers/tiny-llama/chat_template.jinja"),
    ),
];

/// A directory holding the tiny model's tokenizer files (written on first use, in the system's
/// temporary directory, one per process).
pub fn tiny_model_dir() -> Result<PathBuf, String> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("rankgate-tiny-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for (name, bytes) in FILES {
            let path = dir.join(name);
            std::fs::write(&path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        Ok(dir)
    })
    .clone()
}

/// The engine's tokenizer from a model directory: chat bodies through the chat template,
/// completions' prompts as vLLM tokenizes them, generated text without special tokens.
pub fn tokenizer(dir: &Path) -> Result<SimTokenizer, String> {
    let t = Arc::new(ChatTokenizer::from_dir(dir).map_err(|e| e.to_string())?);
    let text = t.clone();
    Ok(SimTokenizer::new(
        move |body| {
            let bytes = serde_json::to_vec(body).ok()?;
            let ids = match body.get("messages") {
                Some(_) => t.chat(&bytes),
                None => t.completion(&bytes),
            };
            ids.ok().map(|t| t.ids)
        },
        move |s| text.text(s, false).ok().map(|t| t.ids),
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_tiny_model_tokenizes_a_chat_as_the_engine_did() {
        let t = super::tokenizer(&super::tiny_model_dir().unwrap()).unwrap();
        let golden: serde_json::Value = serde_json::from_slice(include_bytes!(
            "../../../../tests/fixtures/vllm-0.32-kv-events/chat_tokenize_golden.json"
        ))
        .unwrap();
        let body = serde_json::json!({"model": "tiny-llama", "messages": golden[0]["messages"]});
        let want: Vec<u32> = serde_json::from_value(golden[0]["tokenize"].clone()).unwrap();
        assert_eq!(t.prompt_ids(&body), Some(want));
        assert!(t.text_ids("t1 t2").is_some_and(|ids| !ids.is_empty()));
    }

    #[test]
    fn the_capture_fixture_names_the_shipped_files() {
        // The fixture directory links to the shipped files (one copy): the tokenizer the capture
        // was made with is the one a user's `[[models]]` points at.
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        for (name, bytes) in super::FILES {
            let fixture = root.join("tests/fixtures/vllm-0.32-kv-events").join(name);
            assert_eq!(
                std::fs::read(&fixture).unwrap(),
                bytes,
                "{}",
                fixture.display()
            );
            let shipped = root.join(super::SHIPPED_DIR).join(name);
            assert_eq!(
                std::fs::read(&shipped).unwrap(),
                bytes,
                "{}",
                shipped.display()
            );
        }
    }
}
