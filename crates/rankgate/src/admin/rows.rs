//! The `/workers` rows that are not one rank's live state: an engine not shaped yet, and the
//! models column every row carries.

use std::sync::Arc;

use serde_json::{json, Value};

use crate::worker::{Deployment, EngineEntry, Flavor};

/// A `/workers` row for an engine that has no workers yet because it has not said its flavor or
/// DP size: it takes no traffic, and the row says why.
pub(super) fn unshaped_row(e: &Arc<EngineEntry>) -> Value {
    let why = e.unshaped.load();
    // A group member's size and a configured size are not asked; only what is missing is.
    let size_known = e.declared.dp_size.is_some() || e.deployment != Deployment::Own;
    let what = match (e.declared.flavor, size_known) {
        (None, false) => "flavor and DP size",
        (None, true) => "flavor",
        (Some(_), _) => "DP size",
    };
    let reason = format!(
        "{what} not known yet: {}",
        why.as_deref().map_or("not asked yet", String::as_str)
    );
    let row = json!({
        "id": e.url.as_ref(),
        "engine": e.url.as_ref(),
        "dp_rank": null,
        "flavor": e.declared.flavor.map_or("unknown", Flavor::as_str),
        "role": e.role.as_str(),
        "telemetry": "unavailable",
        "reason": reason,
        "reason_kind": "shape_unknown",
        "source": null,
        // Not known: the shape question's failure may be a silent engine or one that
        // answered something else (`reason` says which).
        "reachable": null,
        "health": "unknown",
        "in_flight": 0,
        "consecutive_failures": 0,
    });
    with_models(row, None, false)
}

/// `row` with its engine's `models` once known (`models_state`: `configured` or `read`), and
/// without them while the engine has not told them yet (`pending`): an empty list would read as
/// an engine that serves nothing, when it is one that requests are routed to as if it might
/// serve any model.
pub(super) fn with_models(
    mut row: Value,
    models: Option<&[crate::catalog::Model]>,
    fixed: bool,
) -> Value {
    let state = match (models, fixed) {
        (None, _) => "pending",
        (Some(_), true) => "configured",
        (Some(_), false) => "read",
    };
    if let Value::Object(o) = &mut row {
        if let Some(l) = models {
            let ids = l.iter().map(|m| Value::from(m.id.as_str())).collect();
            o.insert("models".into(), Value::Array(ids));
        }
        o.insert("models_state".into(), state.into());
    }
    row
}
