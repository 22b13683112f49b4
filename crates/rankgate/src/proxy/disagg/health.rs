//! How each leg of a disaggregated request ended, as the operator sees it: counted by leg and
//! kind (`rankgate_pd_failures`), the rank's run of failed legs kept (shown in `/workers`), and
//! a side that fails leg after leg logged at WARN once, with what most likely causes it. A
//! prefill/decode fleet misconfigured (a prefill server without a KV connector, a wrong SGLang
//! bootstrap port, flavors that cannot pair) fails every request while each rank looks
//! healthy to its telemetry: this is where that becomes visible.
//!
//! Only a leg's end comes here, never a whole request's path.

use crate::metrics::{likely_cause, PdCounts, PdFailure, PdLeg, PD_FAILING_AFTER};
use crate::worker::{Flavor, Member};

/// A leg that ended well on `worker`: its run of failures is over.
pub(crate) fn leg_ok(worker: &Member) {
    worker.counters.pd_health.ok();
}

/// A leg that failed: counted, and held against the rank it went to (`None`: it went to
/// none). The rank's [`PD_FAILING_AFTER`]th failure in a row logs its engine at WARN, once.
pub(crate) fn leg_failed(
    pd: &PdCounts,
    leg: PdLeg,
    kind: PdFailure,
    worker: Option<&Member>,
    flavor: Flavor,
) {
    pd.failed(leg, kind);
    let Some(w) = worker else {
        return;
    };
    if w.counters.pd_health.failed(kind) < PD_FAILING_AFTER {
        return;
    }
    let engine = &w.id.engine;
    let key = format!("{engine} {} {}", leg.as_str(), kind.as_str());
    if pd.first_warning(&key) {
        tracing::warn!(
            engine = %engine,
            worker = %w.id_text,
            leg = leg.as_str(),
            kind = kind.as_str(),
            failed_in_a_row = PD_FAILING_AFTER,
            likely_cause = likely_cause(leg, kind, flavor),
            "a {} side fails every disaggregated request", leg.as_str()
        );
    }
}

/// A request that could not be split (its model's prefill and decode servers cannot pair):
/// counted on the prefill leg, logged at WARN once per reason.
pub(crate) fn unpaired(pd: &PdCounts, why: &str) {
    pd.failed(PdLeg::Prefill, PdFailure::Unpaired);
    if pd.first_warning(why) {
        tracing::warn!(
            leg = "prefill",
            kind = PdFailure::Unpaired.as_str(),
            likely_cause = why,
            "disaggregated requests cannot be served"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warning_is_given_once() {
        let pd = PdCounts::default();
        assert!(pd.first_warning("x"));
        assert!(!pd.first_warning("x"));
        assert!(pd.first_warning("y"));
        unpaired(&pd, "flavors differ");
        unpaired(&pd, "flavors differ");
        assert_eq!(pd.failures(PdLeg::Prefill, PdFailure::Unpaired), 2);
    }
}
