//! The names an explanation gives its verdicts: the [`Rule`] that decided for or against each
//! candidate, the reason a rank was no candidate ([`Skip`]), and the affinity limits compared.
//! Types only, so that both the explanation and the verdicts can name them.

use serde::Serialize;

/// Why a candidate won (the picked one) or lost (every other).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// Won: its ejection ran out and this request is its trial, which goes before any score.
    Trial,
    /// Won by prefix affinity: it holds the most of the prompt among the ranks scoring within
    /// `affinity_margin` of the best and below `affinity_max_kv`.
    Affinity,
    /// Won: the lowest score, or drawn at random among those within `tie_margin` of it.
    LeastLoad,
    /// Won: the fewest requests in flight (no rank had fresh telemetry).
    FewestInFlight,
    /// Won: `round_robin`'s turn or `random`'s draw.
    Turn,
    /// Lost: a rank due for its trial goes first.
    TrialFirst,
    /// Lost: as good as the picked rank (within `tie_margin`, or also due for its trial); the
    /// random draw went to the other.
    Tie,
    /// Lost: a higher score (or more in flight) than the picked rank.
    HigherLoad,
    /// Lost to affinity: within its limits, but holding less of the prompt than the picked
    /// rank (or as much, at a higher score).
    HoldsLess,
    /// Lost: it holds some of the prompt, but scores more than `affinity_margin` above the best.
    OutsideMargin,
    /// Lost: it holds some of the prompt, but scores at or above `affinity_max_kv`.
    AboveMaxKv,
    /// Lost: `round_robin`'s turn or `random`'s draw went to another rank.
    NotItsTurn,
    /// No rank was picked.
    NotPicked,
}

impl Rule {
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::Trial => "trial",
            Rule::Affinity => "affinity",
            Rule::LeastLoad => "least_load",
            Rule::FewestInFlight => "fewest_in_flight",
            Rule::Turn => "turn",
            Rule::TrialFirst => "trial_first",
            Rule::Tie => "tie",
            Rule::HigherLoad => "higher_load",
            Rule::HoldsLess => "holds_less",
            Rule::OutsideMargin => "outside_margin",
            Rule::AboveMaxKv => "above_max_kv",
            Rule::NotItsTurn => "not_its_turn",
            Rule::NotPicked => "not_picked",
        }
    }
}

/// Why a rank was no candidate at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Skip {
    /// It (or its engine, at the transport level) failed an earlier attempt of this request.
    FailedEarlier,
    /// Ejected after consecutive failures (an outlier).
    Ejected,
    /// Its telemetry is missing, stale or invalid: unknown is not idle.
    Telemetry,
    /// Its engine did not answer the last poll (policies that need no telemetry).
    Unreachable,
    /// Its engine does not serve this request's front door, model, route or leg.
    NotServing,
}

/// The affinity limits a holder of the prompt had to be within, as the pick compared them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AffinityLimits {
    /// `routing.affinity_margin`.
    pub margin: f64,
    /// `routing.affinity_max_kv`.
    pub max_kv: f64,
    /// The best candidate's score, which the margin counts from.
    pub best: f64,
    /// `best + margin`: a holder scoring above it is outside the margin.
    pub limit: f64,
}
