//! `[[routes]]`: model routes, validated into the table the snapshot carries
//! ([`crate::model_routes`]). Each names the model clients send (`model`), the models it goes to
//! with their weights (`targets`), and optionally a header whose value keeps one client on one
//! target (`sticky_header`).
//!
//! Routes do not chain (a target may not be a route) and a route is not its own target: the
//! rewrite happens once, and what it writes is a model an engine serves. They are not a restart
//! key: a reload swaps them with the catalog.

use serde::Deserialize;

use super::engine::Engine;
use super::error::{invalid, ConfigError};
use crate::model_routes::{Route, Routes};

/// A target's weight when the file gives none.
pub const DEFAULT_TARGET_WEIGHT: u32 = 1;
/// A weight at most (the Gateway API's own bound): weights are shares, and a million to one is
/// finer than any rollout needs.
pub const MAX_TARGET_WEIGHT: u32 = 1_000_000;
/// Routes at most: each route and target is a series of `rankgate_route_requests_total`, so the
/// series stay at most `MAX_ROUTES * MAX_TARGETS`.
pub const MAX_ROUTES: usize = 256;
/// Targets of one route at most.
pub const MAX_TARGETS: usize = 16;
/// A route's or target's model name at most (Hugging Face ids run to about a hundred).
pub const MAX_MODEL_NAME_BYTES: usize = 256;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRoute {
    model: String,
    #[serde(default)]
    targets: Vec<RawTarget>,
    sticky_header: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTarget {
    model: String,
    /// Signed, so that a negative weight is refused by name here rather than as a TOML type.
    weight: Option<i64>,
}

/// A model name as a route or target gives it: not empty, not past [`MAX_MODEL_NAME_BYTES`],
/// no control characters (it goes into a JSON body and a metrics label).
pub(super) fn name(key: &str, v: &str) -> Result<(), ConfigError> {
    if v.is_empty() || v.len() > MAX_MODEL_NAME_BYTES {
        return Err(invalid(
            key,
            format!("must be 1 to {MAX_MODEL_NAME_BYTES} bytes"),
        ));
    }
    if v.chars().any(char::is_control) {
        return Err(invalid(key, format!("{v:?} has a control character")));
    }
    Ok(())
}

fn weight(key: &str, w: Option<i64>) -> Result<u32, ConfigError> {
    match w.unwrap_or(i64::from(DEFAULT_TARGET_WEIGHT)) {
        w if w < 0 => Err(invalid(key, format!("{w} is negative"))),
        w if w > i64::from(MAX_TARGET_WEIGHT) => Err(invalid(
            key,
            format!("{w} is more than {MAX_TARGET_WEIGHT}"),
        )),
        // Within 0..=MAX_TARGET_WEIGHT: fits.
        w => Ok(w as u32),
    }
}

pub(super) fn model_routes(raw: Vec<RawRoute>) -> Result<Routes, ConfigError> {
    if raw.len() > MAX_ROUTES {
        return Err(invalid(
            "routes",
            format!("{} routes; at most {MAX_ROUTES}", raw.len()),
        ));
    }
    // Every route's name first: a target naming a later route is a chain too.
    for (i, r) in raw.iter().enumerate() {
        name(&format!("routes[{i}].model"), &r.model)?;
        if let Some(j) = raw[..i].iter().position(|o| o.model == r.model) {
            return Err(invalid(
                format!("routes[{i}].model"),
                format!("{:?} is already routes[{j}]", r.model),
            ));
        }
    }
    let mut routes = Vec::with_capacity(raw.len());
    for (i, r) in raw.iter().enumerate() {
        let key = |k: &str| format!("routes[{i}].{k}");
        if r.targets.is_empty() {
            return Err(invalid(
                key("targets"),
                "at least one target is required: targets = [{ model = \"...\", weight = 1 }]",
            ));
        }
        if r.targets.len() > MAX_TARGETS {
            return Err(invalid(
                key("targets"),
                format!("{} targets; at most {MAX_TARGETS}", r.targets.len()),
            ));
        }
        let mut targets: Vec<(String, u32)> = Vec::with_capacity(r.targets.len());
        for (j, t) in r.targets.iter().enumerate() {
            let key = |k: &str| format!("routes[{i}].targets[{j}].{k}");
            name(&key("model"), &t.model)?;
            if t.model == r.model {
                return Err(invalid(
                    key("model"),
                    format!("{:?} is the route's own name: a route's targets are models the engines serve, under other names", t.model),
                ));
            }
            if let Some(k) = raw.iter().position(|o| o.model == t.model) {
                return Err(invalid(
                    key("model"),
                    format!("{:?} is itself a route (routes[{k}]): routes do not chain, so name the model it sends to", t.model),
                ));
            }
            if let Some(k) = targets.iter().position(|(m, _)| *m == t.model) {
                return Err(invalid(
                    key("model"),
                    format!("{:?} is already targets[{k}]: give it one weight", t.model),
                ));
            }
            targets.push((t.model.clone(), weight(&key("weight"), t.weight)?));
        }
        if targets.iter().all(|(_, w)| *w == 0) {
            return Err(invalid(
                key("targets"),
                "every weight is 0: at least one target must take requests",
            ));
        }
        let sticky_header = match &r.sticky_header {
            None => None,
            Some(h) => Some(http::HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                invalid(
                    key("sticky_header"),
                    format!("{h:?} is not a valid HTTP header name"),
                )
            })?),
        };
        routes.push(Route::new(&r.model, targets, sticky_header));
    }
    Ok(Routes::new(routes))
}

/// Legal but likely mistaken routes, as far as the file tells the engines' models (only
/// `engines[].models` fixes them): a route shadowing a model an engine serves, and, when every
/// model list is fixed and nothing else can bring engines, a target none of them serves.
pub(super) fn warnings(routes: &Routes, engines: &[Engine], closed: bool) -> Vec<String> {
    let fixed = |m: &str| {
        (engines.iter()).position(|e| e.models.as_ref().is_some_and(|l| l.iter().any(|x| x == m)))
    };
    let all_fixed = closed && engines.iter().all(|e| e.models.is_some());
    let mut out = Vec::new();
    for (i, r) in routes.iter().enumerate() {
        if let Some(e) = fixed(&r.name) {
            out.push(format!("routes[{i}].model: {:?} is also a model engines[{e}] serves: requests naming it follow the route", &*r.name));
        }
        for (j, t) in r.targets.iter().enumerate() {
            if all_fixed && t.weight > 0 && fixed(&t.model).is_none() {
                out.push(format!("routes[{i}].targets[{j}].model: no engine serves {:?} (engines[].models): the requests the route sends there get 404", &*t.model));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    const ENGINE: &str = "[[engines]]\nurl = \"http://a:1\"\nflavor = \"vllm\"\n";

    fn parse(routes: &str) -> Result<Config, String> {
        Config::from_str(&format!("{ENGINE}{routes}")).map_err(|e| e.to_string())
    }

    /// The error `routes` gets: it must name `key`.
    fn refused(routes: &str, key: &str) -> String {
        let e = parse(routes).expect_err("refused");
        assert!(
            e.contains(&format!("key `{key}`")),
            "{e} does not name {key}"
        );
        e
    }

    #[test]
    fn a_canary_an_alias_and_a_sticky_rollout_parse() {
        let c = parse(
            "[[routes]]\nmodel = \"chat\"\ntargets = [{ model = \"llama-3.1-8b\", weight = 90 }, { model = \"llama-3.2-8b\", weight = 10 }]\n\
             [[routes]]\nmodel = \"fast\"\ntargets = [{ model = \"qwen\" }]\n\
             [[routes]]\nmodel = \"big\"\nsticky_header = \"X-Gateway-Inference-Fairness-Id\"\ntargets = [{ model = \"a\", weight = 0 }, { model = \"b\", weight = 3 }]\n",
        )
        .unwrap();
        let chat = c.routes.get("chat").unwrap();
        let w: Vec<(&str, u32)> = chat.targets.iter().map(|t| (&*t.model, t.weight)).collect();
        assert_eq!(w, [("llama-3.1-8b", 90), ("llama-3.2-8b", 10)]);
        assert_eq!(
            c.routes.get("fast").unwrap().targets[0].weight,
            super::DEFAULT_TARGET_WEIGHT
        );
        let big = c.routes.get("big").unwrap();
        assert_eq!(
            big.sticky_header.as_ref().unwrap(),
            "x-gateway-inference-fairness-id"
        );
        assert!(parse("").unwrap().routes.is_empty());
    }

    #[test]
    fn bad_routes_are_refused_naming_the_key() {
        refused("[[routes]]\nmodel = \"chat\"\n", "routes[0].targets");
        refused(
            "[[routes]]\nmodel = \"chat\"\ntargets = []\n",
            "routes[0].targets",
        );
        let e = refused(
            "[[routes]]\nmodel = \"chat\"\ntargets = [{ model = \"a\", weight = 0 }, { model = \"b\", weight = 0 }]\n",
            "routes[0].targets",
        );
        assert!(e.contains("every weight is 0"), "{e}");
        let e = refused(
            "[[routes]]\nmodel = \"chat\"\ntargets = [{ model = \"a\", weight = -1 }]\n",
            "routes[0].targets[0].weight",
        );
        assert!(e.contains("negative"), "{e}");
        refused(
            "[[routes]]\nmodel = \"chat\"\ntargets = [{ model = \"a\", weight = 1000001 }]\n",
            "routes[0].targets[0].weight",
        );
        refused(
            "[[routes]]\nmodel = \"chat\"\ntargets = [{ model = \"a\" }, { model = \"chat\" }]\n",
            "routes[0].targets[1].model",
        );
        let e = refused(
            "[[routes]]\nmodel = \"chat\"\ntargets = [{ model = \"a\" }]\n[[routes]]\nmodel = \"chat\"\ntargets = [{ model = \"b\" }]\n",
            "routes[1].model",
        );
        assert!(e.contains("already routes[0]"), "{e}");
        // A chain, whichever comes first in the file.
        let e = refused(
            "[[routes]]\nmodel = \"chat\"\ntargets = [{ model = \"fast\" }]\n[[routes]]\nmodel = \"fast\"\ntargets = [{ model = \"b\" }]\n",
            "routes[0].targets[0].model",
        );
        assert!(e.contains("itself a route (routes[1])"), "{e}");
        refused(
            "[[routes]]\nmodel = \"chat\"\ntargets = [{ model = \"a\" }, { model = \"a\" }]\n",
            "routes[0].targets[1].model",
        );
        refused(
            "[[routes]]\nmodel = \"chat\"\nsticky_header = \"bad header\"\ntargets = [{ model = \"a\" }]\n",
            "routes[0].sticky_header",
        );
        refused(
            "[[routes]]\nmodel = \"\"\ntargets = [{ model = \"a\" }]\n",
            "routes[0].model",
        );
        refused(
            "[[routes]]\nmodel = \"chat\"\ntargets = [{ model = \"a\\n\" }]\n",
            "routes[0].targets[0].model",
        );
        let many: String = (0..=super::MAX_TARGETS)
            .map(|i| format!("{{ model = \"m{i}\" }}"))
            .collect::<Vec<_>>()
            .join(", ");
        refused(
            &format!("[[routes]]\nmodel = \"chat\"\ntargets = [{many}]\n"),
            "routes[0].targets",
        );
        let e = parse("[[routes]]\nmodel = \"chat\"\nweights = 1\ntargets = [{ model = \"a\" }]\n")
            .expect_err("unknown key");
        assert!(e.contains("weights"), "{e}");
    }

    #[test]
    fn a_shadowed_model_and_a_target_no_fixed_list_has_are_warned_of() {
        let c = Config::from_str(
            "[[engines]]\nurl = \"http://a:1\"\nflavor = \"vllm\"\nmodels = [\"chat\", \"a\"]\n\
             [[routes]]\nmodel = \"chat\"\ntargets = [{ model = \"a\" }, { model = \"b\" }, { model = \"c\", weight = 0 }]\n",
        )
        .unwrap();
        let w = super::warnings(&c.routes, &c.engines, true);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].starts_with("routes[0].model: \"chat\" is also a model engines[0] serves"));
        assert!(w[1].starts_with("routes[0].targets[1].model: no engine serves \"b\""));
        // Engines that may come from elsewhere may serve it.
        assert_eq!(super::warnings(&c.routes, &c.engines, false).len(), 1);
    }

    #[test]
    fn routes_are_not_a_restart_key() {
        let a = parse("").unwrap();
        let b = parse("[[routes]]\nmodel = \"chat\"\ntargets = [{ model = \"a\" }]\n").unwrap();
        assert!(a.restart_needed(&b).is_empty());
    }
}
