//! `[[adapters]]`: LoRA adapters rankgate loads on demand, each with its `name` (the model
//! clients send), its `base` (the model whose servers can load it) and its `path` (where the
//! engine reads it, as vLLM's `POST /v1/load_lora_adapter` takes `lora_path`). Validated into
//! the routes table ([`crate::model_routes::Declared`]), so a reload swaps them with it.

use std::sync::Arc;

use serde::Deserialize;

use super::error::{invalid, ConfigError};
use super::model_routes::name;
use crate::model_routes::{Declared, Routes};

/// Declared adapters at most: each is a load rankgate may start, and a row of `/adapters`.
pub const MAX_DECLARED_ADAPTERS: usize = 1024;
/// A `path` at most (Linux's `PATH_MAX`).
pub const MAX_ADAPTER_PATH_BYTES: usize = 4096;
/// An adapter's name at most: error messages repeat a model's name up to 200 characters, and an
/// adapter is found again by what they repeat.
pub const MAX_ADAPTER_NAME_BYTES: usize = 200;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdapter {
    name: String,
    base: String,
    path: String,
}

/// What is wrong with `v` as an adapter's name, if anything: 1 to [`MAX_ADAPTER_NAME_BYTES`]
/// bytes, no control character (it goes into JSON bodies, logs and metrics labels), no space
/// at either end (a name that looks like another).
pub fn adapter_name_problem(v: &str) -> Option<String> {
    if v.is_empty() || v.len() > MAX_ADAPTER_NAME_BYTES {
        return Some(format!(
            "must be 1 to {MAX_ADAPTER_NAME_BYTES} bytes; it is {}",
            v.len()
        ));
    }
    if v.chars().any(char::is_control) {
        return Some(format!("{v:?} has a control character"));
    }
    if v.trim() != v {
        return Some(format!("{v:?} begins or ends with a space"));
    }
    None
}

/// What is wrong with `v` as an adapter's path, if anything.
pub fn adapter_path_problem(v: &str) -> Option<String> {
    if v.is_empty() || v.len() > MAX_ADAPTER_PATH_BYTES {
        return Some(format!(
            "must be 1 to {MAX_ADAPTER_PATH_BYTES} bytes; it is {}",
            v.len()
        ));
    }
    v.chars()
        .any(char::is_control)
        .then(|| format!("{v:?} has a control character"))
}

/// `raw` validated onto `routes`: names unique among adapters and routes; a base is a model,
/// not another adapter or a route.
pub(super) fn adapters(raw: Vec<RawAdapter>, routes: Routes) -> Result<Routes, ConfigError> {
    if raw.len() > MAX_DECLARED_ADAPTERS {
        return Err(invalid(
            "adapters",
            format!("{} adapters; at most {MAX_DECLARED_ADAPTERS}", raw.len()),
        ));
    }
    let mut out: Vec<Declared> = Vec::with_capacity(raw.len());
    for (i, a) in raw.into_iter().enumerate() {
        let key = |k: &str| format!("adapters[{i}].{k}");
        if let Some(why) = adapter_name_problem(&a.name) {
            return Err(invalid(key("name"), why));
        }
        name(&key("base"), &a.base)?;
        if a.base == a.name {
            return Err(invalid(
                key("base"),
                "names the adapter itself: give the model the adapter was trained on",
            ));
        }
        if let Some(why) = adapter_path_problem(&a.path) {
            return Err(invalid(key("path"), why));
        }
        if let Some(j) = out.iter().position(|d| *d.name == a.name) {
            return Err(invalid(
                key("name"),
                format!("{:?} is already adapters[{j}]", a.name),
            ));
        }
        if routes.get(&a.name).is_some() {
            return Err(invalid(
                key("name"),
                format!(
                    "{:?} is also a route ([[routes]]): a name is one or the other",
                    a.name
                ),
            ));
        }
        out.push(Declared {
            name: Arc::from(a.name),
            base: Arc::from(a.base),
            path: Arc::from(a.path),
        });
    }
    for (i, d) in out.iter().enumerate() {
        let what = match (
            out.iter().position(|o| o.name == d.base),
            routes.get(&d.base),
        ) {
            (Some(j), _) => format!("adapters[{j}]"),
            (None, Some(_)) => "a route ([[routes]])".to_string(),
            (None, None) => continue,
        };
        return Err(invalid(
            format!("adapters[{i}].base"),
            format!(
                "{:?} is {what}: a base is the model the adapter was trained on",
                d.base
            ),
        ));
    }
    Ok(routes.with_adapters(out))
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    const ENGINE: &str = "[[engines]]\nurl = \"http://a:1\"\nflavor = \"vllm\"\n";

    fn parse(tail: &str) -> Result<Config, String> {
        Config::from_str(&format!("{ENGINE}{tail}")).map_err(|e| e.to_string())
    }

    #[test]
    fn declared_adapters_are_read_and_bad_ones_named() {
        let c = parse("[[adapters]]\nname = \"sql\"\nbase = \"llama\"\npath = \"/loras/sql\"\n")
            .unwrap();
        let d = c.routes.declared("sql").unwrap();
        assert_eq!((&*d.base, &*d.path), ("llama", "/loras/sql"));
        for (tail, key) in [
            ("[[adapters]]\nname = \"\"\nbase = \"b\"\npath = \"p\"\n", "adapters[0].name"),
            ("[[adapters]]\nname = \"a\"\nbase = \"a\"\npath = \"p\"\n", "adapters[0].base"),
            ("[[adapters]]\nname = \"a\"\nbase = \"b\"\npath = \"\"\n", "adapters[0].path"),
            ("[[adapters]]\nname = \"a\"\nbase = \"b\"\npath = \"p\\n\"\n", "adapters[0].path"),
            ("[[adapters]]\nname = \"a\"\nbase = \"b\"\npath = \"p\"\n[[adapters]]\nname = \"a\"\nbase = \"b\"\npath = \"q\"\n", "adapters[1].name"),
            ("[[routes]]\nmodel = \"a\"\ntargets = [{ model = \"b\" }]\n[[adapters]]\nname = \"a\"\nbase = \"b\"\npath = \"p\"\n", "adapters[0].name"),
            ("[[adapters]]\nname = \"a\"\nbase = \"b\"\n", "path"),
            ("[[adapters]]\nname = \"a\"\nbase = \"b\"\npath = \"p\"\nrank = 8\n", "rank"),
        ] {
            let e = parse(tail).unwrap_err();
            assert!(e.contains(key), "{tail:?}: {e}");
        }
        for tail in [
            "[[adapters]]\nname = \" a\"\nbase = \"b\"\npath = \"p\"\n",
            "[[adapters]]\nname = \"a\"\nbase = \"c\"\npath = \"p\"\n[[adapters]]\nname = \"c\"\nbase = \"b\"\npath = \"q\"\n",
            "[[routes]]\nmodel = \"r\"\ntargets = [{ model = \"b\" }]\n[[adapters]]\nname = \"a\"\nbase = \"r\"\npath = \"p\"\n",
        ] {
            let e = parse(tail).unwrap_err();
            assert!(e.contains("adapters[0]"), "{tail:?}: {e}");
        }
        let sglang = "[[engines]]\nurl = \"http://b:1\"\nflavor = \"sglang\"\nmax_adapters = 2\n";
        let e = parse(sglang).unwrap_err();
        assert!(e.contains("engines[1].max_adapters"), "{e}");
        let long = "x".repeat(201);
        let e = parse(&format!(
            "[[adapters]]\nname = \"{long}\"\nbase = \"b\"\npath = \"p\"\n"
        ))
        .unwrap_err();
        assert!(e.contains("1 to 200 bytes"), "{e}");
    }
}
