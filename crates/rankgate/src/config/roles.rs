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

/// Warnings (a side is certainly missing) and notes (what is decided per request).
#[derive(Debug, Default, PartialEq)]
pub struct RoleCheck {
    pub warnings: Vec<String>,
    pub notes: Vec<String>,
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
    let mut out = RoleCheck::default();
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
