//! A model's tokenizer files: where they are and what `tokenizer_config.json` says.
//!
//! A Hugging Face model directory holds `tokenizer.json` (the tokenizer itself),
//! `tokenizer_config.json` (special tokens, `add_bos_token`, often the chat template) and, since
//! transformers 4.47, the chat template on its own in `chat_template.jinja`, which then wins over
//! the config's (transformers loads it that way, and so does vLLM through transformers).

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::error::TokenizeError;

/// Where a model's tokenizer files are. [`TokenizerFiles::in_dir`] fills it from a model
/// directory; each path can also be given on its own (an operator's `--chat-template` override).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizerFiles {
    /// `tokenizer.json`: required.
    pub tokenizer: PathBuf,
    /// `tokenizer_config.json`: special tokens and maybe the chat template.
    pub config: Option<PathBuf>,
    /// A template file that wins over the config's `chat_template`.
    pub chat_template: Option<PathBuf>,
}

impl TokenizerFiles {
    /// The files of the model directory `dir`: `tokenizer.json` must exist; the config and
    /// `chat_template.jinja` are taken when present.
    pub fn in_dir(dir: &Path) -> Result<TokenizerFiles, TokenizeError> {
        let tokenizer = dir.join("tokenizer.json");
        if !tokenizer.is_file() {
            return Err(TokenizeError::Read {
                path: tokenizer,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no tokenizer.json in the model directory",
                ),
            });
        }
        let present = |name: &str| Some(dir.join(name)).filter(|path| path.is_file());
        Ok(TokenizerFiles {
            tokenizer,
            config: present("tokenizer_config.json"),
            chat_template: present("chat_template.jinja"),
        })
    }

    /// The directory named in "no chat template" errors.
    pub(crate) fn dir(&self) -> PathBuf {
        self.tokenizer
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default()
    }
}

pub(crate) fn read(path: &Path) -> Result<Vec<u8>, TokenizeError> {
    std::fs::read(path).map_err(|source| TokenizeError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// What the template and the completions path need from `tokenizer_config.json`.
#[derive(Debug, Default, Clone)]
pub(crate) struct Config {
    /// `bos_token`, `eos_token`, ... as the template sees them (transformers passes its
    /// `special_tokens_map` to every render), in the config's order.
    pub specials: Vec<(String, String)>,
    pub additional_special_tokens: Vec<String>,
    /// The chat templates by name: one unnamed ("default") or a list of named ones.
    pub templates: Vec<(String, String)>,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
}

/// The special-token attributes transformers puts in `special_tokens_map`.
const SPECIAL_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

impl Config {
    pub fn load(path: &Path) -> Result<Config, TokenizeError> {
        let bytes = read(path)?;
        Config::parse(&bytes).map_err(|detail| TokenizeError::Config {
            path: path.to_path_buf(),
            detail,
        })
    }

    pub fn parse(bytes: &[u8]) -> Result<Config, String> {
        let value: Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
        let Value::Object(map) = value else {
            return Err("not a JSON object".into());
        };
        let mut config = Config::default();
        for name in SPECIAL_NAMES {
            match map.get(name) {
                None | Some(Value::Null) => {}
                Some(token) => {
                    let content = token_content(token).ok_or_else(|| {
                        format!("{name}: neither a string nor an added token with a content")
                    })?;
                    config.specials.push((name.to_string(), content));
                }
            }
        }
        if let Some(Value::Array(list)) = map.get("additional_special_tokens") {
            for token in list {
                let content = token_content(token)
                    .ok_or("additional_special_tokens: an entry is neither a string nor a token")?;
                config.additional_special_tokens.push(content);
            }
        }
        match map.get("chat_template") {
            None | Some(Value::Null) => {}
            Some(Value::String(source)) => {
                config.templates.push(("default".into(), source.clone()));
            }
            // transformers saves several templates as [{"name": ..., "template": ...}].
            Some(Value::Array(list)) => {
                for entry in list {
                    let name = entry.get("name").and_then(Value::as_str);
                    let source = entry.get("template").and_then(Value::as_str);
                    let (Some(name), Some(source)) = (name, source) else {
                        return Err(
                            "chat_template: a list entry lacks a string name or template".into(),
                        );
                    };
                    config.templates.push((name.into(), source.into()));
                }
            }
            Some(_) => return Err("chat_template: neither a string nor a list".into()),
        }
        config.add_bos_token = flag(&map, "add_bos_token")?;
        config.add_eos_token = flag(&map, "add_eos_token")?;
        Ok(config)
    }

    pub fn special(&self, name: &str) -> Option<&str> {
        self.specials
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, content)| content.as_str())
    }
}

/// A special token as a string: either the string itself or an added-token object's `content`.
fn token_content(token: &Value) -> Option<String> {
    match token {
        Value::String(s) => Some(s.clone()),
        Value::Object(map) => map.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

fn flag(map: &serde_json::Map<String, Value>, key: &str) -> Result<Option<bool>, String> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(format!("{key}: not a boolean")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_tokens_as_strings_or_added_tokens() {
        let config = Config::parse(
            br#"{"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
                "eos_token": "</s>", "pad_token": null, "add_bos_token": true}"#,
        )
        .unwrap();
        assert_eq!(config.special("bos_token"), Some("<s>"));
        assert_eq!(config.special("eos_token"), Some("</s>"));
        assert_eq!(config.special("pad_token"), None);
        assert_eq!(config.add_bos_token, Some(true));
    }

    #[test]
    fn named_templates_are_kept_by_name() {
        let config = Config::parse(
            br#"{"chat_template": [{"name": "default", "template": "d"},
                {"name": "tool_use", "template": "t"}]}"#,
        )
        .unwrap();
        let names: Vec<(&str, &str)> = config
            .templates
            .iter()
            .map(|(n, t)| (n.as_str(), t.as_str()))
            .collect();
        assert_eq!(names, [("default", "d"), ("tool_use", "t")]);
    }

    #[test]
    fn wrong_shapes_say_which_key() {
        let err = Config::parse(br#"{"chat_template": 3}"#).unwrap_err();
        assert!(err.contains("chat_template"), "{err}");
        let err = Config::parse(br#"{"bos_token": 1}"#).unwrap_err();
        assert!(err.contains("bos_token"), "{err}");
        let err = Config::parse(br#"{"add_bos_token": "yes"}"#).unwrap_err();
        assert!(err.contains("add_bos_token"), "{err}");
        assert!(Config::parse(b"[").unwrap_err().contains("not JSON"));
    }
}
