//! The rule that decided each candidate of an explained pick: why the picked rank won (its
//! trial, prefix affinity, the least load, a draw among equals, its turn) and why every other
//! rank lost, with the figures compared (a holder of the prompt above `affinity_max_kv` or
//! outside `affinity_margin` says so, with its score and the limit).
//!
//! Worked out from the explanation's own scores and holdings, which come from the snapshot and
//! the instant the pick used, and from what the pick itself reported deciding ([`By`]); only a
//! pick that is explained pays for it.

use super::explain::{By, Explanation, Rules};
use super::rule::{AffinityLimits, Rule};
use crate::config::Policy;

/// A figure as the explanation prints it: at most four decimals, no trailing zeros.
fn num(v: f64) -> String {
    let s = format!("{v:.4}");
    match s.contains('.') {
        true => s.trim_end_matches('0').trim_end_matches('.').to_string(),
        false => s,
    }
}

/// Names the rule for every candidate of `x`, whose picked rank (if any) is first.
pub(super) fn judge(x: &mut Explanation, rules: &Rules) {
    // Affinity had a prompt to match (each candidate's holdings were asked).
    let has_prompt = x.prompt_chunks.is_some();
    let first = x.candidates.first();
    let picked = first.filter(|c| x.picked.as_deref() == Some(c.worker.as_str()));
    let Some(p) = picked else {
        for c in &mut x.candidates {
            c.rule = Rule::NotPicked;
            c.why = "no rank was picked".to_string();
        }
        return;
    };
    let (p_score, p_held, p_worker) = (p.score, p.cached_tokens.unwrap_or(0), p.worker.clone());
    let by = rules.by;
    let trials = x.candidates.iter().filter(|c| c.trial).count();
    if by != By::Reachable && trials > 0 {
        for (i, c) in x.candidates.iter_mut().enumerate() {
            (c.rule, c.why) = if i == 0 {
                let among = match trials {
                    1 => String::new(),
                    n => format!(" (drawn among {n} ranks due for theirs)"),
                };
                let why = format!("its ejection ran out: this request is its trial, which goes before any score{among}");
                (Rule::Trial, why)
            } else if c.trial {
                let why = format!("also due for its trial: the draw went to {p_worker}");
                (Rule::Tie, why)
            } else {
                let why = format!("{p_worker} is due for its trial, which goes first");
                (Rule::TrialFirst, why)
            };
        }
        return;
    }
    let n = x.candidates.len();
    match by {
        By::Reachable => {
            let how = match rules.policy {
                Policy::Random => "random's draw",
                _ => "round_robin's turn",
            };
            for (i, c) in x.candidates.iter_mut().enumerate() {
                (c.rule, c.why) = match i {
                    0 => (Rule::Turn, format!("{how} among the {n} reachable ranks")),
                    _ => (Rule::NotItsTurn, format!("{how} went to {p_worker}")),
                };
            }
        }
        By::InFlight => {
            let ps = p_score.unwrap_or(0.0);
            for (i, c) in x.candidates.iter_mut().enumerate() {
                let s = c.score.unwrap_or(0.0);
                (c.rule, c.why) = if i == 0 {
                    let why = format!("the fewest requests in flight ({}) among the reachable ranks: no rank has fresh telemetry (routing.no_telemetry = \"least_in_flight\")", num(s));
                    (Rule::FewestInFlight, why)
                } else if s <= ps {
                    let why = format!("as few in flight ({}): the draw went to {p_worker}", num(s));
                    (Rule::Tie, why)
                } else {
                    let why = format!(
                        "{} in flight (with recent failures), more than the picked rank's {}",
                        num(s),
                        num(ps)
                    );
                    (Rule::HigherLoad, why)
                };
            }
        }
        By::Kv | By::Affinity | By::Adapter => {
            by_score(x, rules, has_prompt, (p_score, p_held, p_worker))
        }
    }
}

/// `least_kv`'s rules: affinity within its limits, else the least score (ties drawn).
fn by_score(
    x: &mut Explanation,
    rules: &Rules,
    has_prompt: bool,
    (p_score, p_held, p_worker): (Option<f64>, u64, String),
) {
    let by = rules.by;
    let scores = x.candidates.iter().filter_map(|c| c.score);
    let best = scores.fold(f64::INFINITY, f64::min);
    // The pick's own tolerance: scores are sums of floats.
    let tie = best + rules.tie_margin.max(1e-9);
    let ties = (x.candidates.iter())
        .filter(|c| c.score.is_some_and(|s| s <= tie))
        .count();
    let limits = (rules.affinity.filter(|_| has_prompt)).map(|(margin, max_kv)| AffinityLimits {
        margin,
        max_kv,
        best,
        limit: best + margin,
    });
    x.affinity = limits;
    let ps = p_score.unwrap_or(0.0);
    let tm = num(rules.tie_margin);
    for (i, c) in x.candidates.iter_mut().enumerate() {
        let s = c.score.unwrap_or(0.0);
        let held = c.cached_tokens.unwrap_or(0);
        let whose = c.cached_by.unwrap_or("record");
        let holds = format!("holds {held} of the prompt's leading tokens (by {whose})");
        (c.rule, c.why) = match (i, limits) {
            (0, Some(l)) if by == By::Affinity => {
                let why = format!(
                    "{holds}, the most among ranks scoring within affinity_margin {} of the best {} (at most {}) and below affinity_max_kv {}; its score {}",
                    num(l.margin), num(l.best), num(l.limit), num(l.max_kv), num(s)
                );
                (Rule::Affinity, why)
            }
            (0, _) => {
                let mut why = match ties {
                    0 | 1 => format!("the lowest score, {}", num(s)),
                    n => format!(
                        "score {}, within tie_margin {tm} of the best {}: drawn at random among {n}",
                        num(s),
                        num(best)
                    ),
                };
                if limits.is_some() {
                    why.push_str("; no rank within the affinity limits holds any of the prompt");
                }
                (Rule::LeastLoad, why)
            }
            (_, Some(l)) if held > 0 && s >= l.max_kv => {
                let also = match s > l.limit {
                    true => format!(
                        ", and more than affinity_margin {} above the best {}",
                        num(l.margin),
                        num(l.best)
                    ),
                    false => String::new(),
                };
                let why = format!(
                    "{holds}, but its score {} is at or above affinity_max_kv {}{also}",
                    num(s),
                    num(l.max_kv)
                );
                (Rule::AboveMaxKv, why)
            }
            (_, Some(l)) if held > 0 && s > l.limit => {
                let why = format!(
                    "{holds}, but its score {} is more than affinity_margin {} above the best {} (at most {})",
                    num(s), num(l.margin), num(l.best), num(l.limit)
                );
                (Rule::OutsideMargin, why)
            }
            (_, Some(l)) if by == By::Affinity && s <= l.limit && s < l.max_kv => {
                let why = match held < p_held {
                    true => format!("{holds}, fewer than the {p_held} the picked rank holds"),
                    false => format!(
                        "{holds}, as many as the picked rank, at a higher score {}",
                        num(s)
                    ),
                };
                (Rule::HoldsLess, why)
            }
            _ if by == By::Kv && s <= tie => {
                let why = format!(
                    "score {}, within tie_margin {tm} of the best {}: the random draw went to {p_worker}",
                    num(s),
                    num(best)
                );
                (Rule::Tie, why)
            }
            _ => {
                let why = format!("score {}, above the picked rank's {}", num(s), num(ps));
                (Rule::HigherLoad, why)
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::num;

    #[test]
    fn figures_read_short() {
        assert_eq!(num(0.5), "0.5");
        assert_eq!(num(0.1 + 0.2), "0.3");
        assert_eq!(num(1.0), "1");
        assert_eq!(num(0.12345), "0.1235");
    }
}
