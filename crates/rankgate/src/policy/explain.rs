//! Why a pick went where it did: every rank the request could have gone to, scored, or passed
//! over with the reason. Built only for a request that asks (a traced request's span, or
//! `x-rankgate-debug`), from the snapshot and the instant the pick itself used, so it never
//! tells a different story from the pick. The usual request never builds one.

use std::fmt::Write;

use serde::Serialize;
use tokio::time::Instant;

use super::affinity::Holdings;
use super::avoid::{eligible, Avoid};
use super::rule::{AffinityLimits, Rule, Skip};
use super::scoring::{score, trickle_full};
use crate::config::Policy;
use crate::ix::WorkerIx;
use crate::outlier::Admit;
use crate::table::{Snapshot, Table, FRESH_TRICKLE};

/// What the candidates were ranked by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum By {
    /// `least_kv`'s score: reported KV usage plus the work sent since the poll.
    #[default]
    Kv,
    /// Requests in flight: `least_kv` when no rank has fresh telemetry and
    /// `routing.no_telemetry = "least_in_flight"`.
    InFlight,
    /// Nothing: `round_robin` and `random` take any reachable rank.
    Reachable,
    /// `least_kv` with prefix affinity: among the ranks within `affinity_margin` of the best
    /// score and below `affinity_max_kv`, the one holding the most of the prompt.
    Affinity,
    /// `least_kv` for a LoRA adapter: among the ranks within `affinity_margin` of the best
    /// score, the least loaded running it, else the least loaded with a free adapter slot.
    Adapter,
}

/// A pick, explained.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Explanation {
    /// The leg of a disaggregated request this pick was for (`prefill`, `decode`); absent for
    /// a whole request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leg: Option<&'static str>,
    pub policy: &'static str,
    pub by: By,
    /// The worker chosen; `None` when no rank could take the request.
    pub picked: Option<String>,
    /// The ranks that could have taken it: the picked one first, then lowest score (the best)
    /// first.
    pub candidates: Vec<Candidate>,
    /// The ranks passed over, and why.
    pub skipped: Vec<Skipped>,
    /// Ranks of engines that do not serve this request at all (its front door, model, route
    /// or leg): not candidates; each is listed last in `skipped`, with why.
    pub not_serving: usize,
    /// With prefix affinity and a `least_kv` pick by score: the limits a rank holding the
    /// prompt had to be within, with the figures the pick compared.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity: Option<AffinityLimits>,
    /// With prefix affinity: the prompt's chunks (see [`crate::prefix`]); 0 when it has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_chunks: Option<usize>,
    /// With `routing.kv_events`: the prompt's leading tokens, as its model's tokenizer (the
    /// engine's) counts them; absent when it was not tokenized.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<usize>,
    /// Entries left out of the two lists to keep the explanation within its size.
    #[serde(skip_serializing_if = "is_zero")]
    pub omitted: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub worker: String,
    /// Lower wins; none under `round_robin` and `random`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub score: Option<f64>,
    /// Its ejection ran out and this request may be its trial: it goes first.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub trial: bool,
    /// With prefix affinity: how many of the prompt's leading chunks this rank was sent
    /// before. Affinity prefers the longest among ranks within `affinity_margin` of the best.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix: Option<usize>,
    /// With prefix affinity: the prompt's leading tokens this rank holds (the prefill a hit
    /// there saves), and by whose account: `events` (its engine's KV events) or `record`
    /// (rankgate's record of the chunks it sent, at 64 tokens a chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cached_by: Option<&'static str>,
    /// The rule that decided for it (the picked one) or against it (every other).
    pub rule: Rule,
    /// The same in words, with the figures compared.
    pub why: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Skipped {
    pub worker: String,
    /// Why it was no candidate, as a name to match on.
    pub rule: Skip,
    pub why: String,
}

impl By {
    pub fn as_str(self) -> &'static str {
        match self {
            By::Kv => "kv",
            By::InFlight => "in_flight",
            By::Reachable => "reachable",
            By::Affinity => "affinity",
            By::Adapter => "adapter",
        }
    }
}

impl Explanation {
    /// Names the picked worker and moves it to the front of the candidates (a tie or affinity
    /// can pick one that is not the lowest), so no cut of the list leaves it out.
    fn set_picked(&mut self, worker: Option<String>) {
        if let Some(i) = (self.candidates.iter()).position(|c| Some(&c.worker) == worker.as_ref()) {
            let picked = self.candidates.remove(i);
            self.candidates.insert(0, picked);
        }
        self.picked = worker;
    }

    pub(super) fn new(policy: Policy, by: By) -> Explanation {
        Explanation {
            policy: policy.as_str(),
            by,
            ..Explanation::default()
        }
    }

    /// The candidates as `worker=score[rule]` (a span attribute).
    pub fn candidates_text(&self) -> String {
        let mut out = String::new();
        for c in &self.candidates {
            let sep = if out.is_empty() { "" } else { " " };
            let _ = match c.score {
                Some(s) => write!(out, "{sep}{}={s:.4}", c.worker),
                None => write!(out, "{sep}{}", c.worker),
            };
            if c.trial {
                out.push_str("(trial)");
            }
            if let Some(p) = c.prefix {
                let _ = write!(out, "(prefix {p})");
            }
            if let (Some(t), Some(by)) = (c.cached_tokens, c.cached_by) {
                let _ = write!(out, "(cached {t} by {by})");
            }
            let _ = write!(out, "[{}]", c.rule.as_str());
        }
        out
    }

    /// The skipped ranks as `worker: why` lines joined by `; ` (a span attribute); ranks that
    /// do not serve the request at all are left to `not_serving`'s count.
    pub fn skipped_text(&self) -> String {
        let mut out = String::new();
        for s in self.skipped.iter().filter(|s| s.rule != Skip::NotServing) {
            let sep = if out.is_empty() { "" } else { "; " };
            let _ = write!(out, "{sep}{}: {}", s.worker, s.why);
        }
        out
    }

    /// One line of JSON of at most `max` bytes: when the whole would be longer (a large
    /// fleet), the lists keep their first entries (the best candidates, and the picked one
    /// always) and `omitted` says how many were left out.
    pub fn to_json(&self, max: usize) -> String {
        let mut x = self.clone();
        loop {
            let text = serde_json::to_string(&x).unwrap_or_default();
            if text.len() <= max || (x.candidates.is_empty() && x.skipped.is_empty()) {
                return text;
            }
            // Halve the longer list; a few rounds reach any size.
            let list = if x.skipped.len() >= x.candidates.len() {
                x.skipped.len()
            } else {
                x.candidates.len()
            };
            let keep = list / 2;
            x.omitted += list - keep;
            if x.skipped.len() >= x.candidates.len() {
                x.skipped.truncate(keep);
            } else {
                x.candidates.truncate(keep);
            }
        }
    }
}

/// What the explanation needs of the selector's settings, and what decided the pick.
pub(super) struct Rules {
    pub policy: Policy,
    /// What ranked the candidates, as the pick itself reported it ([`By::Affinity`] when
    /// affinity chose).
    pub by: By,
    pub tie_margin: f64,
    /// `(affinity_margin, affinity_max_kv)` with `routing.prefix_affinity`.
    pub affinity: Option<(f64, f64)>,
}

/// Explains a pick of `picked` (none: no rank) made by `rules` over `snap` at `now`.
pub(super) fn explain_pick(
    table: &Table,
    snap: &Snapshot,
    now: Instant,
    avoid: &Avoid,
    rules: &Rules,
    holdings: &mut Holdings,
    picked: Option<WorkerIx>,
) -> Explanation {
    let by = rules.by;
    let mut x = Explanation::new(rules.policy, by);
    x.leg = (avoid.leg != super::avoid::Leg::Whole).then(|| avoid.leg.as_str());
    x.prompt_tokens = holdings.prompt().tokens.as_ref().map(|t| t.len());
    // A prompt not read (too large to keep, not JSON, shorter than a chunk) matches nothing
    // and says so by its absence.
    let mut prompt = Some(holdings).filter(|p| rules.affinity.is_some() && !p.is_empty());
    if let Some(p) = &prompt {
        x.prompt_chunks = Some(p.prompt().chunks.len());
    }
    let fleet = &snap.fleet;
    let mut not_serving = Vec::new();
    for (w, seat) in fleet.workers.iter_enumerated() {
        let engine = &fleet.engines[seat.engine];
        let worker = seat.id_text.to_string();
        if !avoid.may_serve(engine) {
            x.not_serving += 1;
            not_serving.push(Skipped {
                worker,
                rule: Skip::NotServing,
                why: avoid.why_not_serving(engine).to_string(),
            });
            continue;
        }
        let view = &snap.ranks[w];
        let admit = seat.live.outlier.admit();
        let why = if avoid.workers.contains(&seat.key) {
            Some((
                Skip::FailedEarlier,
                "failed an earlier attempt of this request".to_string(),
            ))
        } else if avoid.engines.contains(&engine.key) {
            let why = "its engine failed an earlier attempt of this request (transport)";
            Some((Skip::FailedEarlier, why.to_string()))
        } else if !eligible(fleet, seat, avoid) {
            Some((
                Skip::Ejected,
                "ejected after consecutive failures".to_string(),
            ))
        } else {
            match by {
                By::Kv | By::Affinity | By::Adapter => (view.telemetry)
                    .unavailable_reason(now, table.stale_after)
                    .map(|r| (Skip::Telemetry, format!("telemetry: {r}")))
                    .or_else(|| {
                        trickle_full(view, &seat.member).then(|| {
                            let why = format!("fresh: no load gauges yet, and its trickle of {FRESH_TRICKLE} requests in flight is full");
                            (Skip::Telemetry, why)
                        })
                    }),
                By::InFlight | By::Reachable => (!view.reachable).then(|| {
                    let why = "unreachable: its engine did not answer the last poll";
                    (Skip::Unreachable, why.to_string())
                }),
            }
        };
        if let Some((rule, why)) = why {
            x.skipped.push(Skipped { worker, rule, why });
            continue;
        }
        let live = &seat.live;
        let score = match by {
            By::Kv | By::Affinity | By::Adapter => score(table, snap, w, now, avoid.leg),
            By::InFlight => Some(live.in_flight() as f64 + live.outlier.recent_failures()),
            By::Reachable => None,
        };
        let mut c = Candidate {
            worker,
            score,
            trial: admit == Admit::Trial,
            prefix: (prompt.as_ref()).map(|p| seat.prefixes.matched(&p.prompt().chunks)),
            cached_tokens: None,
            cached_by: None,
            rule: Rule::HigherLoad,
            why: String::new(),
        };
        if let Some(p) = prompt.as_mut() {
            let held = p.of(seat);
            c.cached_tokens = Some(held.tokens);
            c.cached_by = Some(if held.exact { "events" } else { "record" });
        }
        x.candidates.push(c);
    }
    // The ranks that do not serve it at all come last: a cut of a long list keeps the others.
    x.skipped.extend(not_serving);
    // Trials first (they are picked first), then by score.
    x.candidates.sort_by(|a, b| {
        (b.trial.cmp(&a.trial)).then(a.score.unwrap_or(0.0).total_cmp(&b.score.unwrap_or(0.0)))
    });
    x.set_picked(picked.map(|w| fleet.workers[w].id_text.to_string()));
    x
}
