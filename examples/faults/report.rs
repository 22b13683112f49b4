//! The rows as the markdown table of `docs/reliability.md`, or as JSON.

use std::time::Duration;

use serde_json::{json, Value};

use crate::run::*;

fn secs(d: Option<Duration>) -> String {
    d.map_or_else(|| "n/a".into(), |d| format!("{:.2} s", d.as_secs_f64()))
}

pub fn markdown(rows: &[Row]) -> String {
    let mut o = String::new();
    o.push_str("| fault | sent | ok | retried (refused) | failed before first byte | streams cut | engine POSTs / request | to eject | to available | to traffic | notes |\n");
    o.push_str("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let failed = if r.failed_before_first_byte.is_empty() {
            "0".to_string()
        } else {
            let parts: Vec<String> = r
                .failed_before_first_byte
                .iter()
                .map(|(k, n)| format!("{k}×{n}"))
                .collect();
            format!("{} ({})", r.failed_total(), parts.join(", "))
        };
        let cut = r.cut_error_event + r.cut_no_done;
        let cut = if cut == 0 {
            "0".to_string()
        } else {
            format!(
                "{cut} ({} error event, {} no [DONE])",
                r.cut_error_event, r.cut_no_done
            )
        };
        let eject = match r.to_eject {
            Some(_) => format!("{} ({})", secs(r.to_eject), r.eject_kinds.join(", ")),
            None => "n/a".into(),
        };
        let mut notes = Vec::new();
        if r.ejections > 0 {
            notes.push(format!("{} ejections", r.ejections));
        }
        if r.client_timeouts > 0 {
            notes.push(format!("{} client timeouts", r.client_timeouts));
        }
        notes.extend(r.notes.iter().cloned());
        notes.push(format!(
            "in flight after the load: {}, engines still holding: {}",
            r.in_flight_end.map_or("?".into(), |n| n.to_string()),
            r.engine_open_end.map_or("?".into(), |n| n.to_string())
        ));
        let per_request = if r.sent == 0 {
            "n/a".into()
        } else {
            format!("{:.2}", r.engine_posts as f64 / r.sent as f64)
        };
        o.push_str(&format!(
            "| `{}`: {} | {} | {} | {} ({}) | {} | {} | {} | {} | {} | {} | {} |\n",
            r.name,
            r.title,
            r.sent,
            r.ok,
            r.retried,
            r.retries_refused,
            failed,
            cut,
            per_request,
            eject,
            secs(r.to_available),
            secs(r.to_traffic),
            notes.join("; ")
        ));
    }
    o
}

pub fn ms(d: Option<Duration>) -> Value {
    d.map_or(Value::Null, |d| json!(d.as_millis() as u64))
}

pub fn to_json(rows: &[Row]) -> Value {
    Value::Array(
        rows.iter()
            .map(|r| {
                json!({
                    "fault": r.name,
                    "title": r.title,
                    "sent": r.sent,
                    "ok": r.ok,
                    "retried": r.retried,
                    "retries_refused": r.retries_refused,
                    "ejections": r.ejections,
                    "failed_before_first_byte": r.failed_before_first_byte,
                    "cut_error_event": r.cut_error_event,
                    "cut_no_done": r.cut_no_done,
                    "client_timeouts": r.client_timeouts,
                    "engine_posts": r.engine_posts,
                    "to_eject_ms": ms(r.to_eject),
                    "eject_reason_kinds": r.eject_kinds,
                    "to_available_ms": ms(r.to_available),
                    "to_traffic_ms": ms(r.to_traffic),
                    "in_flight_end": r.in_flight_end,
                    "engine_open_end": r.engine_open_end,
                    "notes": r.notes,
                    "wall_ms": r.wall.as_millis() as u64,
                })
            })
            .collect(),
    )
}
