//! `GET /adapters`: the LoRA adapters per server (each vLLM server's listed adapters, with their
//! parent, whether `[[adapters]]` declares them, and this router's requests on them), the
//! declared adapters, and the loads running or failed lately; `POST /adapters/load` and
//! `POST /adapters/unload` (`{"server": url, "adapter": name}`, a load optionally with its
//! `"path"`), behind the admin token.

use std::sync::Arc;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::adapter_loads::{listed_adapters, Loader};
use crate::http::{json_response, openai_error};
use crate::table::Table;
use crate::worker::Flavor;

pub fn page(table: &Table, loader: &Loader) -> Value {
    let snap = table.snapshot.load();
    let declared = snap.catalog.routes();
    let servers: Vec<Value> = (snap.fleet.engines.iter_enumerated())
        .filter(|(_, e)| e.http && e.flavor == Flavor::Vllm)
        .map(|(ix, e)| {
            let adapters: Vec<Value> = (listed_adapters(&snap, ix))
                .map(|a| {
                    let uses = e.members.iter().filter_map(|m| m.adapters.last_use(a));
                    let (running, last) = uses.fold((0, None), |(n, last), (r, at)| {
                        (n + r, last.max(Some(at)))
                    });
                    json!({
                        "name": a,
                        "declared": declared.declared(a).is_some(),
                        "requests_in_flight": running,
                        "last_used_seconds_ago": last.map(|t: std::time::Instant| t.elapsed().as_secs()),
                    })
                })
                .collect();
            json!({
                "url": &*e.url,
                "max_adapters": e.max_adapters,
                "models_known": snap.catalog.of(ix).is_some(),
                "adapters": adapters,
            })
        })
        .collect();
    let declared: Vec<Value> = (declared.adapters().iter())
        .map(|d| json!({"name": &*d.name, "base": &*d.base, "path": &*d.path, "served": snap.catalog.listed(&d.name)}))
        .collect();
    let (loading, failed) = loader.status();
    json!({
        "servers": servers,
        "declared": declared,
        "loading": loading,
        "failed": failed,
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HandCall {
    server: String,
    adapter: String,
    path: Option<String>,
}

/// `POST /adapters/load` or `/adapters/unload` with `body`, once authorized.
pub async fn by_hand(loader: Arc<Loader>, load: bool, body: &[u8]) -> Response<Full<Bytes>> {
    let bad = |m: String| openai_error(StatusCode::BAD_REQUEST, "BadRequestError", &m);
    let shape = "the body must be one JSON object {\"server\": <engine url>, \"adapter\": <name>} (a load may add \"path\")";
    let call: HandCall = match serde_json::from_slice::<Value>(body) {
        Ok(v @ Value::Object(_)) => match serde_json::from_value(v) {
            Ok(c) => c,
            Err(e) => return bad(format!("{shape}: {e}")),
        },
        Ok(_) => return bad(shape.to_string()),
        Err(e) => return bad(format!("{shape}: {e}")),
    };
    if let Some(why) = crate::config::adapter_name_problem(&call.adapter) {
        return bad(format!("\"adapter\" {why}"));
    }
    if let Some(why) = call
        .path
        .as_deref()
        .and_then(crate::config::adapter_path_problem)
    {
        return bad(format!("\"path\" {why}"));
    }
    let done = match load {
        true => (loader.load_by_hand(&call.server, &call.adapter, call.path.as_deref())).await,
        false => loader.unload_by_hand(&call.server, &call.adapter).await,
    };
    match done {
        Ok(()) => json_response(
            StatusCode::OK,
            &json!({"server": call.server, "adapter": call.adapter, "loaded": load}),
        ),
        Err(e) => {
            let status = e.status();
            openai_error(status, "AdapterError", &e.to_string())
        }
    }
}
