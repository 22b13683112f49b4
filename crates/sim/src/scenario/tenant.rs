//! A scenario's tenants (`[[workload.tenants]]`): several workloads at once against the same
//! router, each named to it by headers (its fairness id, its objective, any other), each with its
//! own arrivals and sizes, falling back to the `[workload]`'s sizes, bound and seed.

use std::collections::BTreeMap;
use std::sync::Arc;

use http::{HeaderName, HeaderValue};
use serde::Deserialize;

use super::WorkloadSpec;
use crate::load::{
    self, tenants::bounded, Arrivals, Dist, HotPrefix, ModelSpread, Sessions, Tenant, Workload,
    FAIRNESS_HEADER, OBJECTIVE_HEADER,
};
use rankgate::config::HumanDuration;

/// One tenant of a scenario's workload.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    pub name: String,
    /// Sent as `x-gateway-inference-fairness-id`; absent, the tenant's name; `""` sends none.
    pub fairness_id: Option<String>,
    /// Sent as `x-gateway-inference-objective` when given.
    pub objective: Option<String>,
    /// Any other headers, sent with every request of the tenant.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Open loop: arrivals per second.
    pub rate: Option<f64>,
    /// Closed loop: concurrent users.
    pub concurrency: Option<usize>,
    /// Defaults to the workload's `requests`.
    pub requests: Option<usize>,
    /// Defaults to the workload's `duration`, which bounds it.
    pub duration: Option<HumanDuration>,
    /// Default to the workload's.
    pub prompt_tokens: Option<Dist>,
    pub output_tokens: Option<Dist>,
    /// Default to the workload's; the prefix and system prompts are the tenant's own (its seed's),
    /// shared by its requests and by no other tenant's.
    pub hot_prefix: Option<HotPrefix>,
    pub sessions: Option<Sessions>,
    /// Defaults to the workload's seed plus the tenant's place in the list (1, 2, ...).
    pub seed: Option<u64>,
    /// Default to the workload's: the model names its requests are spread over, and how.
    pub models: Option<Vec<String>>,
    pub model_spread: Option<ModelSpread>,
}

impl TenantSpec {
    /// The headers the tenant sends, checked.
    pub fn header_list(&self) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
        let fairness = self.fairness_id.as_deref().unwrap_or(&self.name);
        let named = [(FAIRNESS_HEADER, fairness)]
            .into_iter()
            .chain(self.objective.as_deref().map(|o| (OBJECTIVE_HEADER, o)))
            .filter(|(_, v)| !v.is_empty());
        let extra = self.headers.iter().map(|(k, v)| (k.as_str(), v.as_str()));
        named
            .chain(extra)
            .map(|(k, v)| {
                let name = HeaderName::from_bytes(k.as_bytes())
                    .map_err(|_| format!("header name {k:?} is not a valid HTTP header name"))?;
                let value = HeaderValue::from_str(v)
                    .map_err(|_| format!("header {k}: value {v:?} is not a valid header value"))?;
                Ok((name, value))
            })
            .collect()
    }

    /// Everything wrong with the tenant given the workload it falls back to.
    pub(super) fn validate(&self, w: &WorkloadSpec) -> Result<(), String> {
        if self.name.trim().is_empty() {
            return Err("name must not be empty".into());
        }
        if self.rate.is_some_and(|r| !(r.is_finite() && r > 0.0)) || self.concurrency == Some(0) {
            return Err("`rate` and `concurrency` must be positive".into());
        }
        if self.rate.is_some() == self.concurrency.is_some() {
            return Err(
                "give exactly one of `rate` (open loop) or `concurrency` (closed loop)".into(),
            );
        }
        if self.requests.or(w.requests).is_none() {
            return Err("`requests`: give it here or in [workload]".into());
        }
        if self.output_tokens.or(w.output_tokens).is_none() {
            return Err("`output_tokens`: give it here or in [workload]".into());
        }
        let sessions = self.sessions.as_ref().or(w.sessions.as_ref());
        if self.prompt_tokens.or(w.prompt_tokens).is_none() && sessions.is_none() {
            return Err("`prompt_tokens` (or sessions): give it here or in [workload]".into());
        }
        if let Some(s) = sessions {
            s.validate()?;
            if w.api != load::Api::Chat {
                return Err("sessions are chat conversations: api = \"chat\"".into());
            }
        }
        if let Some(h) = self.hot_prefix.as_ref().or(w.hot_prefix.as_ref()) {
            h.validate()?;
        }
        if let Some(m) = &self.models {
            load::check_models(m).map_err(|e| format!("models: {e}"))?;
        }
        if self.duration.is_some_and(|d| d.0 > w.duration.0) {
            return Err("`duration` is past the workload's: the run ends there".into());
        }
        self.header_list().map(drop)
    }

    /// Its workload: `base` (the target, api, stream, model) with the tenant's own arrivals,
    /// sizes and headers. `i` is its place in the list.
    pub(super) fn tenant(
        &self,
        i: usize,
        w: &WorkloadSpec,
        base: &Workload,
    ) -> Result<Tenant, String> {
        let headers = self
            .header_list()
            .map_err(|e| format!("tenant {:?}: {e}", self.name))?;
        let workload = Workload {
            arrivals: match (self.rate, self.concurrency) {
                (Some(r), _) => Arrivals::Poisson(r),
                (None, c) => Arrivals::Closed(c.unwrap_or(1)),
            },
            requests: self.requests.or(w.requests).unwrap_or(0),
            duration: bounded(self.duration.map(|d| d.0), w.duration.0),
            // Unused by sessions, whose prompts are their own.
            prompt_tokens: (self.prompt_tokens.or(w.prompt_tokens)).unwrap_or(Dist::Fixed(200)),
            output_tokens: (self.output_tokens.or(w.output_tokens)).unwrap_or(Dist::Fixed(64)),
            sessions: self.sessions.clone().or_else(|| w.sessions.clone()),
            hot_prefix: self.hot_prefix.or(w.hot_prefix),
            seed: self.seed.unwrap_or(w.seed.wrapping_add(1 + i as u64)),
            headers: Arc::from(headers),
            models: self.models.clone().unwrap_or_else(|| base.models.clone()),
            model_spread: self.model_spread.unwrap_or(base.model_spread),
            // Several progress lines at once would only garble each other.
            progress: false,
            ..base.clone()
        };
        Ok(Tenant {
            name: self.name.as_str().into(),
            workload,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(extra: &str) -> Result<TenantSpec, String> {
        toml::from_str(&format!("name = \"batch\"\nrate = 5\n{extra}")).map_err(|e| e.to_string())
    }

    #[test]
    fn headers_name_the_tenant_and_bad_ones_are_refused() {
        let t = spec("objective = \"batch\"\nheaders = { x-team = \"b\" }").unwrap();
        let h = t.header_list().unwrap();
        let pairs: Vec<(&str, &str)> = (h.iter())
            .map(|(k, v)| (k.as_str(), v.to_str().unwrap()))
            .collect();
        assert_eq!(
            pairs,
            [
                (FAIRNESS_HEADER, "batch"),
                (OBJECTIVE_HEADER, "batch"),
                ("x-team", "b")
            ]
        );
        let none = spec("fairness_id = \"\"").unwrap().header_list().unwrap();
        assert!(none.is_empty(), "an empty fairness id sends no header");
        let e = spec("headers = { \"bad name\" = \"x\" }")
            .unwrap()
            .header_list()
            .unwrap_err();
        assert!(e.contains("bad name"), "{e}");
        let e = spec("objective = \"a\\nb\"")
            .unwrap()
            .header_list()
            .unwrap_err();
        assert!(e.contains(OBJECTIVE_HEADER), "{e}");
        assert!(spec("colour = 1").unwrap_err().contains("colour"));
    }

    const TWO: &str = r#"
name = "two"
policies = ["least_kv"]
[[engines]]
flavor = "vllm"
dp_size = 2
[workload]
duration = "10s"
requests = 50
prompt_tokens = 100
output_tokens = 16
[[workload.tenants]]
name = "batch"
objective = "batch"
rate = 20
requests = 200
output_tokens = "uniform:32:64"
[[workload.tenants]]
name = "chat"
objective = "interactive"
concurrency = 2
duration = "5s"
headers = { x-team = "web" }
"#;

    #[test]
    fn tenants_fall_back_to_the_workload_and_are_checked() {
        let s = super::super::Scenario::parse(TWO, None).unwrap();
        let w = &s.workload;
        let base = Workload::new("http://127.0.0.1:1");
        let batch = w.tenants[0].tenant(0, w, &base).unwrap();
        let chat = w.tenants[1].tenant(1, w, &base).unwrap();
        assert_eq!(&*batch.name, "batch");
        assert_eq!(batch.workload.arrivals, Arrivals::Poisson(20.0));
        assert_eq!(batch.workload.requests, 200);
        assert_eq!(batch.workload.prompt_tokens, Dist::Fixed(100));
        assert_eq!(batch.workload.duration.as_secs(), 10);
        assert_eq!(chat.workload.arrivals, Arrivals::Closed(2));
        assert_eq!(
            (chat.workload.requests, chat.workload.duration.as_secs()),
            (50, 5)
        );
        assert_eq!(chat.workload.output_tokens, Dist::Fixed(16));
        assert_ne!(batch.workload.seed, chat.workload.seed, "each its own text");
        assert_eq!(chat.workload.headers.len(), 3);
        assert_eq!(batch.workload.url, base.url);

        let bad = |from: &str, to: &str, says: &str| {
            let e = super::super::Scenario::parse(&TWO.replacen(from, to, 1), None).unwrap_err();
            assert!(e.contains(says), "{from} -> {to}: {e}");
        };
        bad(
            "duration = \"10s\"",
            "duration = \"10s\"\nrate = 3",
            "each tenant gives its own",
        );
        bad("concurrency = 2", "", "exactly one");
        bad("concurrency = 2", "rate = 0", "positive");
        bad("name = \"chat\"", "name = \"batch\"", "named twice");
        bad(
            "duration = \"5s\"",
            "duration = \"11s\"",
            "past the workload",
        );
        bad("requests = 50\n", "", "tenants[1] (\"chat\"): `requests`");
        bad("output_tokens = 16\n", "", "`output_tokens`");
        bad("x-team", "\"x team\"", "x team");
        bad(
            "duration = \"10s\"",
            "duration = \"10s\"\ngrpc = true",
            "no grpc",
        );
        // The one-workload form still needs what it always needed.
        let one = TWO.split("[[workload.tenants]]").next().unwrap_or_default();
        bad_one(one, "exactly one");
        bad_one(
            &one.replace("duration", "rate = 2\nduration")
                .replace("output_tokens = 16\n", ""),
            "output_tokens",
        );
    }

    #[test]
    fn a_tenant_spreads_over_its_own_models_or_the_workloads() {
        let text = TWO
            .replacen(
                "requests = 50\n",
                "requests = 50\nmodels = [\"a\", \"b\"]\n",
                1,
            )
            .replacen(
                "objective = \"batch\"\n",
                "objective = \"batch\"\nmodels = [\"c\"]\nmodel_spread = \"random\"\n",
                1,
            );
        let s = super::super::Scenario::parse(&text, None).unwrap();
        let w = &s.workload;
        let base = Workload {
            models: w.models.clone(),
            model_spread: w.model_spread,
            ..Workload::new("http://127.0.0.1:1")
        };
        let batch = w.tenants[0].tenant(0, w, &base).unwrap();
        let chat = w.tenants[1].tenant(1, w, &base).unwrap();
        assert_eq!(batch.workload.models, ["c"]);
        assert_eq!(batch.workload.model_spread, ModelSpread::Random);
        assert_eq!(chat.workload.models, ["a", "b"]);
        assert_eq!(chat.workload.model_spread, ModelSpread::Even);
        let e =
            super::super::Scenario::parse(&text.replace("[\"c\"]", "[\"\"]"), None).unwrap_err();
        assert!(e.contains("models"), "{e}");
    }

    fn bad_one(text: &str, says: &str) {
        let e = super::super::Scenario::parse(text, None).unwrap_err();
        assert!(e.contains(says), "{e}");
    }

    #[test]
    fn the_flow_scenarios_parse_with_their_tenants_and_flow_tables() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../configs/scenarios");
        for name in ["flow-priority", "flow-fairness", "flow-affinity"] {
            let text = std::fs::read_to_string(format!("{dir}/{name}.toml")).unwrap();
            // `max_num_seqs` is an EngineSpec key of its own change (engine.rs); the rest of
            // the file is this module's to check.
            let text: String = (text.lines())
                .filter(|l| !l.starts_with("max_num_seqs"))
                .map(|l| format!("{l}\n"))
                .collect();
            let s = super::super::Scenario::parse(&text, None)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(s.workload.tenants.len() >= 2, "{name}");
            assert!(
                s.flow.is_some() && s.policies.iter().any(|v| v.flow),
                "{name}"
            );
            assert!(
                s.workload.duration.0.as_secs() <= 45,
                "{name}: each variant stays short"
            );
        }
    }
}
