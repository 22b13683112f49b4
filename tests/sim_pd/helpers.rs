//! What the simulated prefill/decode tests share: the captured vLLM exchanges, role servers, a
//! replayed leg, and the PD series of a scrape.

use bytes::Bytes;
use http_body_util::Full;
use rankgate_sim::sim::{PdConfig, PdRole, SimConfig, SimEngine, SimFlavor};
use serde_json::Value;

use crate::common::{engine, get, post, send, Reply};

pub const P_CHAT: &str =
    include_str!("../fixtures/vllm-0.32-pd/dp1/chat-nostream/1_prefill_exchange.json");
pub const D_CHAT: &str =
    include_str!("../fixtures/vllm-0.32-pd/dp1/chat-nostream/2_decode_exchange.json");
pub const METRICS_CHAT: &str =
    include_str!("../fixtures/vllm-0.32-pd/dp1/chat-nostream/3_metrics.json");
pub const P_COMPL: &str =
    include_str!("../fixtures/vllm-0.32-pd/dp1/completions-stream/1_prefill_exchange.json");
pub const D_COMPL: &str =
    include_str!("../fixtures/vllm-0.32-pd/dp1/completions-stream/2_decode_exchange.json");
pub const P_RANK1: &str =
    include_str!("../fixtures/vllm-0.32-pd/dpP2/prank1-chat-nostream/1_prefill_exchange.json");
pub const D_FAILED: &str =
    include_str!("../fixtures/vllm-0.32-pd/dpP2/prank1-chat-nostream/2_decode_exchange.json");

pub fn fixture(text: &str) -> Value {
    serde_json::from_str(text).expect("fixture JSON")
}

pub fn role(flavor: SimFlavor, role: PdRole, dp_size: u32, pd: PdConfig) -> SimConfig {
    SimConfig {
        flavor,
        dp_size,
        role: Some(role),
        pd,
        // Fast enough that the tests wait on little.
        decode_tokens_per_sec: 2000.0,
        ..SimConfig::default()
    }
}

pub async fn vllm_pair(p_dp: u32, pd: PdConfig) -> (SimEngine, SimEngine) {
    let p = engine(role(SimFlavor::Vllm, PdRole::Prefill, p_dp, pd)).await;
    let d = engine(role(
        SimFlavor::Vllm,
        PdRole::Decode,
        1,
        PdConfig::default(),
    ))
    .await;
    (p, d)
}

/// Replays a fixture's request (path, headers, body as given) to `addr`.
pub async fn replay(addr: std::net::SocketAddr, exchange: &Value, body: &Value) -> Reply {
    let url = exchange["request"]["url"].as_str().unwrap();
    let path = &url[url.find("/v1/").unwrap()..];
    let mut req = post(addr, path);
    for (k, v) in exchange["request"]["headers"].as_object().unwrap() {
        if !k.eq_ignore_ascii_case("content-type") {
            req = req.header(k.as_str(), v.as_str().unwrap());
        }
    }
    send(req.body(Full::new(Bytes::from(body.to_string()))).unwrap()).await
}

/// The fixture's D request with P's params in place of the recorded ones.
pub fn decode_body(exchange: &Value, params: &Value) -> Value {
    let mut body = exchange["request"]["body"].clone();
    body["kv_transfer_params"] = params.clone();
    body
}

/// A metric's value from a scrape: the line starting with `series ` (name and labels exactly).
pub fn metric(text: &str, series: &str) -> f64 {
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        .parse()
        .unwrap()
}

pub async fn scrape(e: &SimEngine) -> String {
    String::from_utf8(get(e.addr, "/metrics").await.body.to_vec()).unwrap()
}

pub const E0: &str = "{engine=\"0\",model_name=\"tiny-llama\"}";
