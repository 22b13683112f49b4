//! What the endpoint tests share: an engine serving two models, a table of endpoint cases, a
//! request pinned to a rank, the rank that served it, and a stream's events.

use bytes::Bytes;
use http_body_util::Full;
use rankgate_sim::sim::{SimConfig, SimEngine, SimFlavor};
use serde_json::{json, Value};

use crate::common::{post, send, sim, Reply};

pub fn two_models(flavor: SimFlavor) -> SimConfig {
    SimConfig {
        models: vec!["alpha".into(), "beta".into()],
        ..sim(flavor, 2, 0)
    }
}

/// One endpoint to try: its path, a request body, and a check of the answer's shape.
pub type Case = (&'static str, Value, fn(&Value) -> bool);

/// POSTs `body` pinned to global rank `rank` the way `flavor` is pinned by a router: vLLM by
/// header, SGLang by body field.
pub async fn pinned(
    e: &SimEngine,
    flavor: SimFlavor,
    path: &str,
    mut body: Value,
    rank: u32,
) -> Reply {
    let mut req = post(e.addr, path);
    match flavor {
        SimFlavor::Vllm => req = req.header("x-data-parallel-rank", rank.to_string()),
        SimFlavor::Sglang => body["routed_dp_rank"] = json!(rank),
    }
    send(req.body(Full::new(Bytes::from(body.to_string()))).unwrap()).await
}

pub fn served_by(r: &Reply) -> u32 {
    r.headers["x-sim-rank"].to_str().unwrap().parse().unwrap()
}

/// The `event:` names of an SSE body, and its `data:` payloads.
pub fn sse(r: &Reply) -> (Vec<String>, Vec<String>) {
    let text = String::from_utf8_lossy(&r.body);
    let mut events = Vec::new();
    let mut data = Vec::new();
    for line in text.lines() {
        if let Some(e) = line.strip_prefix("event: ") {
            events.push(e.to_string());
        } else if let Some(d) = line.strip_prefix("data: ") {
            data.push(d.to_string());
        }
    }
    (events, data)
}
