//! What the config alone tells of a disaggregated fleet: for each model, its prefill and decode
//! servers. Roles are static, so a model listed (`engines[].models`) by servers of one side
//! and of none of the other is known at `rankgate check` to be refused on every chat and
//! completion request; a server whose models are read from its `/v1/models` leaves that to be
//! decided per request, which is said as a note rather than guessed.
//!
//! Pure: it reads the validated engines and discovery entries, nothing else. The proxy decides
//! the same question per request from the live catalog (`proxy/select.rs`); this is the
//! operator's early warning, not a rule the router enforces.

use std::collections::BTreeMap;

use super::discovery::{Discovery, Source};
use super::engine::{Engine, Flavor, Role};

impl Engine {
    /// The port an SGLang prefill server's decode peers fetch the KV from, as `/engines` and
    /// `check` show it; `None` for every other engine, and for a prefill server whose flavor
    /// is not known yet (a vLLM one has none).
    pub fn sglang_bootstrap_port(&self) -> Option<u16> {
        let flavor = (self.declared.flavor).or(self.shaped().then_some(self.flavor));
        self.bootstrap_port
            .filter(|_| flavor == Some(Flavor::Sglang))
    }

    /// The role in one word, with an SGLang prefill server's bootstrap port:
    /// `prefill,bootstrap_port=8998` (`check`'s and `check --probe`'s column).
    pub fn role_text(&self) -> String {
        match self.sglang_bootstrap_port() {
            Some(port) => format!("{},bootstrap_port={port}", self.role),
            None => self.role.to_string(),
        }
    }
}

/// Warnings (a side is certainly missing) and notes (what is decided per request), and errors:
/// prefill and decode servers that certainly cannot pair (`check` refuses them).
#[derive(Debug, Default, PartialEq)]
pub struct RoleCheck {
    pub warnings: Vec<String>,
    pub notes: Vec<String>,
    pub errors: Vec<String>,
}

/// Prefill and decode servers whose flavors certainly cannot pair: a disaggregated request
/// needs its model's prefill and decode servers all of one flavor (vLLM's and SGLang's KV
/// transfers cannot meet), else it is refused (503). Certain when the two sides' known
/// flavors have none in common (every split request would mix them), or when the servers
/// listing one model in `models` already have two flavors. `flavor_of` gives each engine's
/// flavor where known (as configured, or as the engine said).
pub fn pairing_errors(
    engines: &[Engine],
    flavor_of: impl Fn(usize, &Engine) -> Option<Flavor>,
) -> Vec<String> {
    let mut errors = Vec::new();
    let sides: Vec<(usize, Role, Option<Flavor>)> = (engines.iter().enumerate())
        .filter(|(_, e)| e.http && e.role.disaggregated())
        .map(|(i, e)| (i, e.role, flavor_of(i, e)))
        .collect();
    let listed = |role: Role| -> Vec<String> {
        (sides.iter().filter(|(_, r, _)| *r == role))
            .map(|(i, _, f)| format!("engines[{i}] {}", f.map_or("unknown", Flavor::as_str)))
            .collect()
    };
    let flavors = |role: Role| -> Option<Vec<Flavor>> {
        (sides.iter().filter(|(_, r, _)| *r == role))
            .map(|(_, _, f)| *f)
            .collect()
    };
    if let (Some(p), Some(d)) = (flavors(Role::Prefill), flavors(Role::Decode)) {
        if !p.is_empty() && !d.is_empty() && !p.iter().any(|f| d.contains(f)) {
            errors.push(format!(
                "prefill servers ({}) and decode servers ({}) have no flavor in common: vLLM's and SGLang's KV transfers cannot meet, so every chat and completion request of their models would be refused (503); serve a model with prefill and decode servers of one flavor",
                listed(Role::Prefill).join(", "),
                listed(Role::Decode).join(", "),
            ));
            return errors;
        }
    }
    let mut models: BTreeMap<&str, Vec<(usize, Flavor)>> = BTreeMap::new();
    for (i, _, f) in &sides {
        for m in engines[*i].models.iter().flatten() {
            if let Some(f) = f {
                models.entry(m.as_str()).or_default().push((*i, *f));
            }
        }
    }
    for (model, servers) in models {
        if servers.iter().any(|(_, f)| *f != servers[0].1) {
            let named: Vec<String> = (servers.iter())
                .map(|(i, f)| format!("engines[{i}] {f}"))
                .collect();
            errors.push(format!(
                "model `{model}` is served disaggregated by servers of different flavors ({}): vLLM's and SGLang's KV transfers cannot meet, so its chat and completion requests would be refused (503)",
                named.join(", ")
            ));
        }
    }
    errors
}

/// Names of the engines, `engines[0], engines[3]`.
fn names(list: &[usize]) -> String {
    let names: Vec<String> = list.iter().map(|i| format!("engines[{i}]")).collect();
    names.join(", ")
}

/// Where an engine of `role` may still come from at runtime: discovery entries of that role (a
/// Kubernetes entry: any pod may carry `rankgate.io/role`), and the admin API.
fn may_join(role: Role, discovery: &[Discovery], admin: bool) -> Option<String> {
    let mut from: Vec<String> = (discovery.iter())
        .filter(|d| d.template.role() == role || matches!(d.source, Source::Kubernetes { .. }))
        .map(|d| d.at.clone())
        .collect();
    if admin {
        from.push("the admin API".into());
    }
    (!from.is_empty()).then(|| from.join(" or "))
}

/// Each model's sides as far as the config knows them: warnings for a side certainly missing
/// (none in the whole fleet, or none listing a model the other side lists while every server
/// of the missing side lists its models), notes for what only the engines can say.
/// `admin`: engines may be added through the admin API.
pub fn role_check(engines: &[Engine], discovery: &[Discovery], admin: bool) -> RoleCheck {
    let mut out = RoleCheck {
        errors: pairing_errors(engines, |_, e| e.declared.flavor),
        ..RoleCheck::default()
    };
    // Only the HTTP front door splits requests: an engine without `url` takes no leg.
    let side = |role: Role| -> Vec<usize> {
        (engines.iter().enumerate())
            .filter(|(_, e)| e.http && e.role == role)
            .map(|(i, _)| i)
            .collect()
    };
    let (prefill, decode) = (side(Role::Prefill), side(Role::Decode));
    let unless = |role: Role| match may_join(role, discovery, admin) {
        Some(from) => format!(", unless {from} adds one"),
        None => String::new(),
    };
    for (present, missing, there, none) in [
        ("prefill", Role::Decode, &prefill, decode.is_empty()),
        ("decode", Role::Prefill, &decode, prefill.is_empty()),
    ] {
        if !there.is_empty() && none {
            out.warnings.push(format!(
                "the fleet has {present} servers ({}) and no {missing} server: their models' chat and completion requests are refused{} (add a {missing} server, or give them role \"both\")",
                names(there),
                unless(missing),
            ));
        }
    }
    if prefill.is_empty() || decode.is_empty() {
        return out;
    }
    // model -> [prefill servers listing it, decode servers listing it]
    let mut models: BTreeMap<&str, [Vec<usize>; 2]> = BTreeMap::new();
    for (i, e) in engines.iter().enumerate() {
        let at = match e.role {
            Role::Prefill => 0,
            Role::Decode => 1,
            Role::Both => continue,
        };
        for m in e.models.iter().flatten().filter(|_| e.http) {
            models.entry(m.as_str()).or_default()[at].push(i);
        }
    }
    let unlisted = |of: &[usize]| -> Vec<usize> {
        let unlisted = of.iter().filter(|&&i| engines[i].models.is_none());
        unlisted.copied().collect()
    };
    let (p_any, d_any) = (unlisted(&prefill), unlisted(&decode));
    for (model, [p, d]) in &models {
        let (missing, present, listed, any, role) = match (p.is_empty(), d.is_empty()) {
            (false, false) => {
                out.notes.push(format!(
                    "model `{model}` is served disaggregated: prefill {}, decode {}",
                    names(p),
                    names(d)
                ));
                continue;
            }
            (false, true) => ("decode", "prefill", p, &d_any, Role::Decode),
            (true, false) => ("prefill", "decode", d, &p_any, Role::Prefill),
            (true, true) => continue,
        };
        if any.is_empty() {
            out.warnings.push(format!(
                "model `{model}` has {present} servers ({}) and no {missing} server lists it: its chat and completion requests are refused{} (add it to a {missing} server's `models`, or give its {present} servers role \"both\")",
                names(listed),
                unless(role),
            ));
        } else {
            out.notes.push(format!(
                "model `{model}` has {present} servers ({}) and no {missing} server lists it: whether {} serve it is decided per request, from their /v1/models",
                names(listed),
                names(any),
            ));
        }
    }
    let unlisted_all: Vec<usize> = p_any.iter().chain(&d_any).copied().collect();
    if !unlisted_all.is_empty() {
        out.notes.push(format!(
            "{} have no `models`: which of the models they serve have both a prefill and a decode server is decided per request, from their /v1/models",
            names(&unlisted_all)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::Config;

    fn check(text: &str) -> super::RoleCheck {
        let c = Config::from_str(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        c.roles()
    }

    fn engine(i: u32, role: &str, models: Option<&str>) -> String {
        let models = models.map_or(String::new(), |m| format!("models = [{m}]\n"));
        format!("[[engines]]\nurl = \"http://e{i}:8000\"\nflavor = \"vllm\"\ndp_size = 1\nrole = \"{role}\"\n{models}")
    }

    #[test]
    fn a_fleet_of_whole_engines_has_nothing_to_say() {
        let c = check("[[engines]]\nurl = \"http://a:1\"\n");
        assert_eq!(c, super::RoleCheck::default());
    }

    #[test]
    fn a_model_with_both_sides_is_named_with_its_servers() {
        let c = check(&(engine(0, "prefill", Some("\"m\"")) + &engine(1, "decode", Some("\"m\""))));
        assert!(c.warnings.is_empty(), "{c:?}");
        assert_eq!(
            c.notes,
            ["model `m` is served disaggregated: prefill engines[0], decode engines[1]"]
        );
    }

    #[test]
    fn a_fleet_without_decode_servers_is_warned_of() {
        let c = check(&(engine(0, "prefill", None) + &engine(1, "both", None)));
        assert_eq!(c.warnings.len(), 1, "{c:?}");
        let w = &c.warnings[0];
        assert!(
            w.starts_with("the fleet has prefill servers (engines[0]) and no decode server:"),
            "{w}"
        );
        assert!(!w.contains("unless"), "{w}");
        // The admin API could add one (`server.admin_token_env` set): said so.
        let text = engine(0, "decode", None);
        let c = Config::from_str(&text).unwrap();
        let w = super::role_check(&c.engines, &c.discovery, true)
            .warnings
            .join("\n");
        assert!(
            w.contains("no prefill server") && w.contains("unless the admin API adds one"),
            "{w}"
        );
    }

    #[test]
    fn a_model_listed_by_one_side_only_is_warned_of_by_name() {
        let text = engine(0, "prefill", Some("\"m\", \"n\"")) + &engine(1, "decode", Some("\"m\""));
        let c = check(&text);
        assert_eq!(c.warnings.len(), 1, "{c:?}");
        let w = &c.warnings[0];
        assert!(
            w.starts_with(
                "model `n` has prefill servers (engines[0]) and no decode server lists it"
            ),
            "{w}"
        );
        // The reverse: a decode server's model no prefill server lists.
        let text = engine(0, "prefill", Some("\"m\"")) + &engine(1, "decode", Some("\"m\", \"x\""));
        let w = check(&text).warnings.join("\n");
        assert!(
            w.contains("model `x` has decode servers (engines[1]) and no prefill server"),
            "{w}"
        );
    }

    #[test]
    fn a_prefill_servers_kv_lease_is_its_own_or_its_flavors_default() {
        use super::super::engine::{SGLANG_KV_LEASE, VLLM_KV_LEASE};
        use std::time::Duration;
        let lease = |text: &str| Config::from_str(text).map(|c| c.engines[0].kv_lease()).ok();
        assert_eq!(lease(&engine(0, "prefill", None)), Some(VLLM_KV_LEASE));
        assert_eq!(VLLM_KV_LEASE, Duration::from_secs(480));
        let sglang = "[[engines]]\nurl = \"http://e:1\"\nflavor = \"sglang\"\nrole = \"prefill\"\n";
        assert_eq!(lease(sglang), Some(SGLANG_KV_LEASE));
        let own = engine(0, "prefill", None) + "kv_lease = \"90s\"\n";
        assert_eq!(lease(&own), Some(Duration::from_secs(90)));
        for (text, why) in [
            (
                engine(0, "decode", None) + "kv_lease = \"90s\"\n",
                "only a prefill server",
            ),
            (
                engine(0, "prefill", None) + "kv_lease = \"0s\"\n",
                "a lease of 0",
            ),
        ] {
            let e = Config::from_str(&text).unwrap_err().to_string();
            assert!(e.contains("engines[0].kv_lease") && e.contains(why), "{e}");
        }
    }

    #[test]
    fn prefill_and_decode_servers_that_cannot_pair_are_errors() {
        let flavored = |i: u32, flavor: &str, role: &str, models: &str| {
            format!("[[engines]]\nurl = \"http://e{i}:8000\"\nflavor = \"{flavor}\"\ndp_size = 1\nrole = \"{role}\"\n{models}")
        };
        let c = check(&(flavored(0, "sglang", "prefill", "") + &flavored(1, "vllm", "decode", "")));
        assert_eq!(c.errors.len(), 1, "{c:?}");
        assert!(c.errors[0].contains("no flavor in common"), "{c:?}");
        assert!(c.errors[0].contains("engines[0] sglang"), "{c:?}");
        // One model's servers of two flavors, though each side has both.
        let m = "models = [\"m\"]\n";
        let text = flavored(0, "vllm", "prefill", m)
            + &flavored(1, "sglang", "prefill", "models = [\"n\"]\n")
            + &flavored(2, "sglang", "decode", m)
            + &flavored(3, "vllm", "decode", "models = [\"n\"]\n");
        let e = check(&text).errors.join("\n");
        assert!(e.contains("model `m`") && e.contains("model `n`"), "{e}");
        // One flavor, or flavors read from the engines: nothing certain.
        assert!(
            check(&(engine(0, "prefill", None) + &engine(1, "decode", None)))
                .errors
                .is_empty()
        );
        let unknown = "[[engines]]\nurl = \"http://e1:8000\"\nrole = \"decode\"\n";
        assert!(check(&(flavored(0, "sglang", "prefill", "") + unknown))
            .errors
            .is_empty());
    }

    #[test]
    fn servers_whose_models_are_read_from_them_leave_it_to_each_request() {
        let text = engine(0, "prefill", Some("\"m\"")) + &engine(1, "decode", None);
        let c = check(&text);
        assert!(c.warnings.is_empty(), "{c:?}");
        let notes = c.notes.join("\n");
        assert!(
            notes.contains("whether engines[1] serve it is decided per request"),
            "{notes}"
        );
        assert!(notes.contains("engines[1] have no `models`"), "{notes}");
    }
}
