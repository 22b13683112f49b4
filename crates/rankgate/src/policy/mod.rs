//! Rank selection: which virtual worker takes the next request.
//!
//! `least_kv` scores each rank with fresh telemetry by its reported KV usage plus the KV that
//! work not yet visible in that report will take: its waiting queue, and the requests this router
//! sent it since the poll began (capped by what is still in flight, so nothing the engine already
//! reports, and nothing already finished, is counted twice). That credit is what spreads a burst
//! between two polls instead of herding it onto the rank that looked idle. Each request is
//! credited by its size relative to the typical request (its Content-Length against a running
//! mean, no body read), so a 1500-token prompt weighs like several short ones. A rank without
//! fresh, valid telemetry is never scored: unknown is not idle.
//!
//! Every policy passes over ejected ranks (see [`crate::outlier`]) and the ranks a retry must
//! avoid; `least_kv` also weighs each rank's consecutive failures, so a rank that fails fast
//! never looks like the idlest one.
//!
//! The pick is one `ArcSwap` load plus relaxed atomic reads: no lock on the request path.
//!
//! One file per concern: `dispatch` (the [`Selector`] and its policies), `least_kv`, `scoring`,
//! `affinity`, `ties`, `in_flight` (the no-telemetry fallback), `avoid` (what a request may
//! not go to), `sizing` (a request's weight), `explain` (why a pick went where it did: every
//! rank, scored or passed over), `verdict` (the rule that decided for or against each
//! candidate) and `rule` (the names of those rules). This file only declares them and
//! re-exports the API.

mod adapters;
mod affinity;
mod avoid;
mod dispatch;
mod explain;
mod in_flight;
mod least_kv;
mod rule;
mod saturation;
mod scoring;
mod sizing;
mod ties;
mod verdict;

pub use avoid::{Avoid, Front, Leg};
pub use dispatch::{NoRank, Picked, Selector};
pub use explain::{By, Candidate, Explanation, Skipped};
pub use rule::{AffinityLimits, Rule, Skip};
pub use scoring::score;
pub use sizing::RequestSizer;

#[cfg(test)]
mod fresh_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod verdict_tests;
