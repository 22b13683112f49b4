//! Whose a request is and how urgent: its tenant (the fairness id) and its objective, read from
//! the request as `[flow]` says. A key bound to a tenant (`server.api_keys_file`: `tenant=`)
//! decides the tenant, and a key's `objective=` is the highest the request may claim: a client
//! cannot raise itself above what its key allows. Without keys, the headers are believed: they
//! are set by a gateway in front, or by clients trusted with their own priority.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderValue};

use crate::config::{FlowConfig, MAX_TENANT_BYTES};

/// What an API key says of the requests it carries (a line of `server.api_keys_file`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyBinding {
    pub tenant: Option<Arc<str>>,
    /// The highest objective its requests may name.
    pub objective: Option<Arc<str>>,
}

/// A request's place in the queue.
#[derive(Debug)]
pub struct Who<'a> {
    pub tenant: &'a str,
    /// Index into `flow.objectives`.
    pub objective: usize,
}

/// A header's value as a tenant id: letters, digits and `-_.:@/+=`, cut to
/// [`MAX_TENANT_BYTES`] (it becomes a label on `/metrics`); anything else is not believed.
fn id(v: &HeaderValue) -> Option<&str> {
    let s = v.to_str().ok()?.trim();
    let s = &s[..s.len().min(MAX_TENANT_BYTES)];
    let ok = |b: u8| b.is_ascii_alphanumeric() || b"-_.:@/+=".contains(&b);
    (!s.is_empty() && s.bytes().all(ok)).then_some(s)
}

/// The request's tenant and objective: the headers looked up by name, the objective's only
/// when there is more than one objective to choose from (every request pays for this while
/// flow control is on).
pub fn who<'a>(
    cfg: &FlowConfig,
    headers: &'a HeaderMap,
    key: Option<&'a KeyBinding>,
    peer: &'a HeaderValue,
) -> Who<'a> {
    let tenant = (key.and_then(|k| k.tenant.as_deref()))
        .or_else(|| headers.get(&cfg.tenant_header).and_then(id))
        .or_else(|| peer.to_str().ok())
        .unwrap_or("unknown");
    if cfg.objectives.len() == 1 {
        return Who {
            tenant,
            objective: 0,
        };
    }
    let asked = (headers.get(&cfg.objective_header))
        .and_then(|v| v.to_str().ok())
        .and_then(|name| cfg.objective(name.trim()))
        .unwrap_or(cfg.default_objective);
    // Objectives are sorted by priority, highest first: the key's ceiling is the lowest index
    // the request may have.
    let ceiling = (key.and_then(|k| k.objective.as_deref()))
        .and_then(|name| cfg.objective(name))
        .unwrap_or(0);
    let objective = if cfg.objectives[asked].priority > cfg.objectives[ceiling].priority {
        ceiling
    } else {
        asked
    };
    Who { tenant, objective }
}

/// How long a request of `objective` may wait: the objective's bound, or the client's own
/// (`flow.max_wait_header`, milliseconds) within it. Read only for a request that waits.
pub fn max_wait(cfg: &FlowConfig, headers: &HeaderMap, objective: usize) -> Duration {
    let own = (headers.get(&cfg.max_wait_header))
        .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
        .map(Duration::from_millis);
    let max_wait = cfg.objectives[objective].max_wait;
    own.map_or(max_wait, |own| own.min(max_wait))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> FlowConfig {
        let objectives = ["premium:100", "default:0", "batch:-10"]
            .iter()
            .map(|s| {
                let (name, p) = s.split_once(':').unwrap();
                crate::config::Objective {
                    name: name.into(),
                    priority: p.parse().unwrap(),
                    max_wait: Duration::from_secs(10),
                    weight: 1.0,
                    engine_priority: None,
                    reserve: 0,
                }
            })
            .collect();
        FlowConfig {
            objectives,
            default_objective: 1,
            ..FlowConfig::default()
        }
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        (pairs.iter())
            .map(|(k, v)| {
                (
                    http::HeaderName::from_static(k),
                    HeaderValue::from_static(v),
                )
            })
            .collect()
    }

    #[test]
    fn headers_name_tenant_objective_and_a_shorter_wait() {
        let (cfg, peer) = (cfg(), HeaderValue::from_static("10.0.0.1"));
        let h = headers(&[
            ("x-gateway-inference-fairness-id", "acme"),
            ("x-gateway-inference-objective", "premium"),
            ("x-rankgate-max-wait-ms", "250"),
        ]);
        let w = who(&cfg, &h, None, &peer);
        assert_eq!((w.tenant, w.objective), ("acme", 0));
        assert_eq!(max_wait(&cfg, &h, 0), Duration::from_millis(250));
        // Unknown objective: the default; no tenant header: the client's address; a longer
        // wait than the objective's is cut to it.
        let h = headers(&[
            ("x-gateway-inference-objective", "gold"),
            ("x-rankgate-max-wait-ms", "99999999"),
        ]);
        let w = who(&cfg, &h, None, &peer);
        assert_eq!((w.tenant, w.objective), ("10.0.0.1", 1));
        assert_eq!(max_wait(&cfg, &h, 1), Duration::from_secs(10));
    }

    #[test]
    fn a_key_binds_the_tenant_and_caps_the_objective() {
        let (cfg, peer) = (cfg(), HeaderValue::from_static("10.0.0.1"));
        let key = KeyBinding {
            tenant: Some("bound".into()),
            objective: Some("default".into()),
        };
        let h = headers(&[
            ("x-gateway-inference-fairness-id", "someone-else"),
            ("x-gateway-inference-objective", "premium"),
        ]);
        let w = who(&cfg, &h, Some(&key), &peer);
        assert_eq!((w.tenant, w.objective), ("bound", 1));
        // Below the ceiling is the client's to choose.
        let h = headers(&[("x-gateway-inference-objective", "batch")]);
        assert_eq!(who(&cfg, &h, Some(&key), &peer).objective, 2);
    }
}
