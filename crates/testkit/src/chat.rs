//! Chat turns through a router and what it predicted of the engines' prefix caches: the
//! KV-event routing tests' shared steps.

use serde_json::{json, Value};

use super::{get, post_json};

/// One chat turn of `max_tokens` through `r`; returns the worker that served it and the answer.
pub async fn turn(
    r: &rankgate::app::Router,
    messages: &[Value],
    max_tokens: u32,
) -> (String, Value) {
    let body = json!({"model": "tiny-llama", "messages": messages, "max_tokens": max_tokens});
    let reply = post_json(r.addr, "/v1/chat/completions", body).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let answer = reply.json()["choices"][0]["message"]["content"].clone();
    (reply.worker(), answer)
}

/// The router's predicted prefix-cache hit tokens over its ranks, by where it learned them
/// (`events` or `record`).
pub async fn predicted(r: &rankgate::app::Router, by: &str) -> f64 {
    let reply = get(r.admin_addr, "/metrics").await;
    let text = String::from_utf8_lossy(&reply.body);
    (text.lines())
        .filter(|l| {
            l.starts_with("rankgate_rank_prefix_predicted_hit_tokens_total")
                && l.contains(&format!("by=\"{by}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
