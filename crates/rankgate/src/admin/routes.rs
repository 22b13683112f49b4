//! `GET /routes`: the model routes (`[[routes]]`) as the current snapshot has them: each
//! route's targets with their weights, the requests sent to each (since the route and target
//! first appeared: a reload that changes weights does not reset them), each target's share of
//! the weight, whether an engine serves it now, and the sticky header if any.

use serde_json::{json, Value};

use crate::table::Table;

pub fn page(table: &Table) -> Value {
    let snap = table.snapshot.load();
    let catalog = &snap.catalog;
    let routes: Vec<Value> = (catalog.routes().iter())
        .map(|r| {
            let total: u64 = r.targets.iter().map(|t| u64::from(t.weight)).sum();
            let targets: Vec<Value> = (r.targets.iter())
                .map(|t| {
                    json!({
                        "model": &*t.model,
                        "weight": t.weight,
                        "share": t.weight as f64 / total.max(1) as f64,
                        "requests": t.served(),
                        "served": catalog.listed(&t.model),
                    })
                })
                .collect();
            json!({
                "model": &*r.name,
                "sticky_header": r.sticky_header.as_ref().map(|h| h.as_str()),
                "targets": targets,
            })
        })
        .collect();
    json!({ "routes": routes })
}
