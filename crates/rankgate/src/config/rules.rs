//! Config rules that look across keys and outside the file: engine health paths, global rank
//! overlap between engines, and warnings for legal but likely mistaken configs.
//!
//! Errors stay pure (they read only the text). Warnings may resolve host names, so they are a
//! separate step (`Config::warnings`, in `whole`) that `main` runs once at startup, keeping
//! `from_str` free of the network.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use super::engine::{Deployment, Engine, Flavor};
use super::error::{invalid, ConfigError};

/// Health path of vLLM and SGLang engines; a gateway is probed only when it names one.
pub const DEFAULT_HEALTH_PATH: &str = "/health";

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
    // Only members of a multi-server deployment can overlap: the pairs are looked at among
    // them, so a large fleet of whole engines costs one pass, not one per pair.
    let members: Vec<(usize, &Engine)> = (engines.iter().enumerate())
        .filter(|(_, e)| matches!(e.deployment, Deployment::Member { .. }))
        .collect();
    for (n, &(j, b)) in members.iter().enumerate() {
        for &(i, a) in &members[..n] {
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

/// An engine as the address check sees it: how a warning names it, what its host resolved to
/// (`Err`: why it did not), and whether warnings about it are wanted.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// `engines[i] (url)` at startup, `url (from source)` for a runtime change.
    pub name: String,
    pub addrs: Result<Vec<SocketAddr>, String>,
    /// Only warnings naming a concerned engine are returned: at startup every engine, on a
    /// runtime change the engines it added or changed (the others were warned about before).
    pub concerned: bool,
}

/// The one check of engine addresses, wherever engines arrive (startup and `rankgate check`,
/// the admin API, a reload, discovery): a host that does not resolve, and two engines on one
/// server (`localhost` and `127.0.0.1`, two names of one host), whose ranks would be polled
/// and counted twice. Pure: the caller resolves.
pub fn address_warnings(engines: &[Resolved]) -> Vec<String> {
    let mut out = Vec::new();
    let mut owner: BTreeMap<SocketAddr, usize> = BTreeMap::new();
    for (j, b) in engines.iter().enumerate() {
        let addrs = match &b.addrs {
            Ok(a) => a,
            Err(e) => {
                if b.concerned {
                    out.push(format!(
                        "{} does not resolve now ({e}); its polls fail until it does",
                        b.name
                    ));
                }
                continue;
            }
        };
        // One warning per pair, on the first shared address.
        let mut seen = Vec::new();
        for a in addrs {
            match owner.get(a) {
                Some(&i) if i != j && !seen.contains(&i) => {
                    seen.push(i);
                    if engines[i].concerned || b.concerned {
                        out.push(format!(
                            "{} and {} both resolve to {a}: one server configured twice is polled twice and its ranks counted twice",
                            engines[i].name, b.name
                        ));
                    }
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

#[cfg(test)]
mod tests;
