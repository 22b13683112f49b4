//! Config rules that bound values or look across keys and outside the file: `[telemetry]`
//! bounds, engine health paths, global rank overlap between engines, and warnings for legal but
//! likely mistaken configs.
//!
//! Errors stay pure (they read only the text). Warnings may resolve host names, so they are a
//! separate step ([`Config::warnings`]) that `main` runs once at startup, keeping `from_str` free
//! of the network.

use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};

use super::{
    invalid, Config, ConfigError, RawTelemetry, TelemetryConfig, DEFAULT_HEALTH_FAILURES,
    DEFAULT_HEALTH_PATH, DEFAULT_INTERVAL, DEFAULT_STALE_AFTER, MAX_INTERVAL, MAX_STALE_AFTER,
    MIN_INTERVAL, MIN_TIMEOUT,
};
use crate::worker::{Deployment, Engine, Flavor};

/// The `[telemetry]` table, with its bounds: each limit is a named constant in the parent.
pub(super) fn telemetry_config(raw: RawTelemetry) -> Result<TelemetryConfig, ConfigError> {
    let interval = raw.interval.map_or(DEFAULT_INTERVAL, |d| d.0);
    let stale_after = raw.stale_after.map_or(DEFAULT_STALE_AFTER, |d| d.0);
    if !(MIN_INTERVAL..=MAX_INTERVAL).contains(&interval) {
        return Err(invalid(
            "telemetry.interval",
            format!("{interval:?} must be between {MIN_INTERVAL:?} and {MAX_INTERVAL:?}"),
        ));
    }
    if stale_after > MAX_STALE_AFTER {
        return Err(invalid(
            "telemetry.stale_after",
            format!("{stale_after:?} must be at most {MAX_STALE_AFTER:?}"),
        ));
    }
    if stale_after <= interval {
        return Err(invalid(
            "telemetry.stale_after",
            format!(
                "{stale_after:?} must be longer than telemetry.interval ({interval:?}), or every rank goes stale between polls"
            ),
        ));
    }
    let timeout = raw.timeout.map_or(stale_after, |d| d.0);
    if timeout < MIN_TIMEOUT {
        return Err(invalid(
            "telemetry.timeout",
            format!("{timeout:?} must be at least {MIN_TIMEOUT:?}"),
        ));
    }
    let health_failures = raw.health_failures.unwrap_or(DEFAULT_HEALTH_FAILURES);
    if health_failures == 0 {
        return Err(invalid(
            "telemetry.health_failures",
            "must be at least 1 (disable probes per engine with health_path = \"\")",
        ));
    }
    Ok(TelemetryConfig {
        interval,
        stale_after,
        timeout,
        health_failures,
    })
}

/// `engines[i].health_path`: the flavor's default when absent (none for a gateway), no probe
/// when `""`, else an absolute path.
pub(super) fn parse_health_path(
    at: &str,
    flavor: Flavor,
    path: Option<&str>,
) -> Result<Option<std::sync::Arc<str>>, ConfigError> {
    let key = format!("{at}.health_path");
    match path {
        None if flavor == Flavor::Gateway => Ok(None),
        None => Ok(Some(DEFAULT_HEALTH_PATH.into())),
        Some("") => Ok(None),
        Some(p) => {
            if !p.starts_with('/') || p.contains(['@', '#']) {
                return Err(invalid(
                    key,
                    format!(
                        "{p:?} must be an absolute path such as \"/health\" (or \"\" for no probe)"
                    ),
                ));
            }
            let _: http::uri::PathAndQuery = p
                .parse()
                .map_err(|_| invalid(&key, format!("{p:?} is not a valid URL path")))?;
            Ok(Some(p.into()))
        }
    }
}

/// Inclusive rendering of a rank range: `4-7`, or `4` alone.
fn ranks_text(r: std::ops::Range<u32>) -> String {
    match r.end - r.start {
        1 => r.start.to_string(),
        _ => format!("{}-{}", r.start, r.end - 1),
    }
}

/// The members of one multi-server DP deployment share its global rank numbering: two members
/// claiming the same rank would make a pinned rank ambiguous. Independent engines and members of
/// different groups number their ranks apart, so nothing is checked between them.
pub(super) fn check_rank_overlap(engines: &[Engine]) -> Result<(), ConfigError> {
    for (j, b) in engines.iter().enumerate() {
        for (i, a) in engines[..j].iter().enumerate() {
            if !a.deployment.shares_ranks_with(&b.deployment, true) {
                continue;
            }
            let (ra, rb) = (a.claimed_ranks(), b.claimed_ranks());
            let common = ra.start.max(rb.start)..ra.end.min(rb.end);
            if !common.is_empty() {
                return Err(invalid(
                    format!("engines[{j}].start_rank"),
                    format!(
                        "engines[{j}] ({}, ranks {}) and engines[{i}] ({}, ranks {}) both claim rank(s) {} of {}: give each member its own start_rank..start_rank+dp_size (or leave start_rank and dp_group out for an engine that is its own DP deployment)",
                        b.url,
                        ranks_text(rb),
                        a.url,
                        ranks_text(ra),
                        ranks_text(common),
                        group_text(&b.deployment),
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// How an error names a DP group.
pub(crate) fn group_text(d: &Deployment) -> String {
    match d {
        Deployment::Member { group: Some(g) } => format!("DP group {g:?}"),
        _ => "the DP group of engines that set start_rank without dp_group".into(),
    }
}

/// Warnings from already-resolved engine addresses (`Err` = the name did not resolve).
fn address_warnings(
    engines: &[Engine],
    resolved: &[Result<Vec<SocketAddr>, String>],
) -> Vec<String> {
    let mut out = Vec::new();
    let mut owner: BTreeMap<SocketAddr, usize> = BTreeMap::new();
    for (j, r) in resolved.iter().enumerate() {
        let addrs = match r {
            Ok(a) => a,
            Err(e) => {
                out.push(format!(
                    "engines[{j}].url: {} does not resolve now ({e}); its polls fail until it does",
                    engines[j].url
                ));
                continue;
            }
        };
        // One warning per pair, on the first shared address.
        let mut seen = Vec::new();
        for a in addrs {
            match owner.get(a) {
                Some(&i) if i != j && !seen.contains(&i) => {
                    seen.push(i);
                    out.push(format!(
                        "engines[{i}] ({}) and engines[{j}] ({}) both resolve to {a}: one server configured twice is polled twice and its ranks counted twice",
                        engines[i].url, engines[j].url
                    ));
                }
                Some(_) => {}
                None => {
                    owner.insert(*a, j);
                }
            }
        }
    }
    out
}

impl Config {
    /// Legal but likely mistaken settings, for `main` to log at startup. Resolves each engine's
    /// host name (blocking, through the system resolver): call it once, before serving.
    pub fn warnings(&self) -> Vec<String> {
        let resolved: Vec<Result<Vec<SocketAddr>, String>> = self
            .engines
            .iter()
            .map(|e| {
                e.authority
                    .to_socket_addrs()
                    .map(Iterator::collect)
                    .map_err(|err| err.to_string())
            })
            .collect();
        address_warnings(&self.engines, &resolved)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn engine(url: &str, flavor: &str, dp: u32, start: u32) -> String {
        format!(
            "[[engines]]\nurl = \"{url}\"\nflavor = \"{flavor}\"\ndp_size = {dp}\nstart_rank = {start}\n"
        )
    }

    fn err(text: &str) -> String {
        Config::from_str(text).unwrap_err().to_string()
    }

    #[test]
    fn overlapping_ranks_name_both_engines() {
        let e = err(&format!(
            "{}{}",
            engine("http://a:1", "vllm", 4, 0),
            engine("http://b:1", "sglang", 2, 3)
        ));
        assert!(e.contains("engines[1].start_rank"), "{e}");
        assert!(
            e.contains("http://a:1") && e.contains("http://b:1") && e.contains("rank(s) 3"),
            "{e}"
        );
        let e = err(&format!(
            "{}{}",
            engine("http://a:1", "vllm", 4, 4),
            engine("http://b:1", "vllm", 8, 0)
        ));
        assert!(e.contains("rank(s) 4-7"), "{e}");
        // Adjacent ranges and gateways are fine.
        Config::from_str(&format!(
            "{}{}[[engines]]\nurl = \"http://g:1\"\nflavor = \"gateway\"\n",
            engine("http://a:1", "vllm", 2, 0),
            engine("http://b:1", "vllm", 2, 2)
        ))
        .unwrap();
    }

    #[test]
    fn independent_engines_never_conflict_and_groups_are_checked_apart() {
        let own =
            |url: &str| format!("[[engines]]\nurl = \"{url}\"\nflavor = \"vllm\"\ndp_size = 2\n");
        let member = |url: &str, group: &str, start: u32| {
            format!("{}dp_group = \"{group}\"\nstart_rank = {start}\n", own(url))
        };
        // Three servers each with ranks 0-1, and two groups both starting at 0.
        let c = Config::from_str(&format!(
            "{}{}{}{}{}",
            own("http://a:1"),
            own("http://b:1"),
            own("http://c:1"),
            member("http://d:1", "x", 0),
            member("http://e:1", "y", 0),
        ))
        .unwrap();
        let ranks: Vec<_> = c.engines.iter().map(|e| e.ranks()).collect();
        assert_eq!(ranks, [0..2, 0..2, 0..2, 0..2, 0..2]);
        assert_eq!(c.engines[0].deployment, Deployment::Own);
        // A named group beside the unnamed one (start_rank alone): apart too.
        Config::from_str(&format!(
            "{}{}",
            member("http://d:1", "x", 0),
            engine("http://f:1", "vllm", 2, 0)
        ))
        .unwrap();
        // Inside a group, an overlap names both members and the group.
        let e = err(&format!(
            "{}{}",
            member("http://d:1", "x", 0),
            member("http://e:1", "x", 1)
        ));
        assert!(
            e.contains("engines[1].start_rank")
                && e.contains("http://d:1")
                && e.contains("http://e:1")
                && e.contains("DP group \"x\""),
            "{e}"
        );
        // The same URL twice is still an error, independent or not.
        let e = err(&format!("{}{}", own("http://a:1"), own("http://a:1")));
        assert!(e.contains("duplicate"), "{e}");
    }

    #[test]
    fn shape_keys_are_checked() {
        let e = err("[[engines]]\nurl = \"http://g:1\"\nflavor = \"gateway\"\ndp_group = \"x\"\n");
        assert!(e.contains("engines[0].dp_group"), "{e}");
        let e = err("[[engines]]\nurl = \"http://a:1\"\ndp_group = \" \"\n");
        assert!(e.contains("engines[0].dp_group"), "{e}");
        let e = err("[[engines]]\nurl = \"http://a:1\"\ntelemetry = [\"prometheus\"]\n");
        assert!(
            e.contains("engines[0].telemetry") && e.contains("flavor"),
            "{e}"
        );
        // url alone: flavor and size are the engine's to say, so it starts without workers.
        let c = Config::from_str("[[engines]]\nurl = \"http://a:1\"\n").unwrap();
        let e = &c.engines[0];
        assert_eq!(
            (e.declared.flavor, e.declared.dp_size, e.dp_size),
            (None, None, 0)
        );
        assert!(!e.shaped());
        // A member's size is its configured share, 1 when unset (as before dp_group).
        let c = Config::from_str(
            "[[engines]]\nurl = \"http://a:1\"\nflavor = \"sglang\"\nstart_rank = 4\n",
        )
        .unwrap();
        assert_eq!(c.engines[0].ranks(), 4..5);
    }

    #[test]
    fn telemetry_bounds() {
        let base = engine("http://a:1", "vllm", 1, 0);
        let e = err(&format!("[telemetry]\ninterval = \"5ms\"\n{base}"));
        assert!(e.contains("telemetry.interval"), "{e}");
        let e = err(&format!(
            "[telemetry]\ninterval = \"2m\"\nstale_after = \"5m\"\n{base}"
        ));
        assert!(e.contains("telemetry.interval"), "{e}");
        let e = err(&format!("[telemetry]\ntimeout = \"1ms\"\n{base}"));
        assert!(e.contains("telemetry.timeout"), "{e}");
        let e = err(&format!("[telemetry]\nstale_after = \"61m\"\n{base}"));
        assert!(e.contains("telemetry.stale_after"), "{e}");
        let e = err(&format!("[telemetry]\nhealth_failures = 0\n{base}"));
        assert!(e.contains("telemetry.health_failures"), "{e}");
        let c = Config::from_str(&format!(
            "[telemetry]\ninterval = \"10ms\"\nstale_after = \"60m\"\ntimeout = \"10ms\"\nhealth_failures = 1\n{base}"
        ))
        .unwrap();
        assert_eq!(c.telemetry.interval, Duration::from_millis(10));
        assert_eq!(c.telemetry.health_failures, 1);
        let c = Config::from_str(&base).unwrap();
        assert_eq!(
            c.telemetry.health_failures,
            super::super::DEFAULT_HEALTH_FAILURES
        );
    }

    #[test]
    fn health_path_defaults_by_flavor() {
        let c = Config::from_str(&format!(
            "{}{}[[engines]]\nurl = \"http://g:1\"\nflavor = \"gateway\"\n{}health_path = \"\"\n",
            engine("http://a:1", "vllm", 1, 0),
            engine("http://b:1", "sglang", 1, 1),
            engine("http://c:1", "vllm", 1, 2),
        ))
        .unwrap();
        let paths: Vec<Option<&str>> = c.engines.iter().map(|e| e.health_path.as_deref()).collect();
        assert_eq!(paths, [Some("/health"), Some("/health"), None, None]);
        let g = Config::from_str(
            "[[engines]]\nurl = \"http://g:1\"\nflavor = \"gateway\"\nhealth_path = \"/ready\"\n",
        )
        .unwrap();
        assert_eq!(g.engines[0].health_path.as_deref(), Some("/ready"));
        let e = err(&format!(
            "{}health_path = \"health\"\n",
            engine("http://a:1", "vllm", 1, 0)
        ));
        assert!(e.contains("engines[0].health_path"), "{e}");
    }

    #[test]
    fn engines_resolving_to_one_address_are_warned_about() {
        let c = Config::from_str(&format!(
            "{}{}{}",
            engine("http://a:1", "vllm", 1, 0),
            engine("http://b:1", "vllm", 1, 1),
            engine("http://c:1", "vllm", 1, 2),
        ))
        .unwrap();
        let same: SocketAddr = "10.0.0.7:8000".parse().unwrap();
        let other: SocketAddr = "10.0.0.8:8000".parse().unwrap();
        let w = address_warnings(
            &c.engines,
            &[
                Ok(vec![same]),
                Ok(vec![other, same]),
                Err("no such host".into()),
            ],
        );
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(
            w[0].contains("engines[0]")
                && w[0].contains("engines[1]")
                && w[0].contains("10.0.0.7:8000"),
            "{w:?}"
        );
        assert!(
            w[1].contains("engines[2].url") && w[1].contains("no such host"),
            "{w:?}"
        );
    }

    #[test]
    fn localhost_and_loopback_ip_are_one_server() {
        let c = Config::from_str(&format!(
            "{}{}",
            engine("http://localhost:18000", "vllm", 1, 0),
            engine("http://127.0.0.1:18000", "vllm", 1, 1),
        ))
        .unwrap();
        let w = c.warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("127.0.0.1:18000"), "{w:?}");
    }
}
