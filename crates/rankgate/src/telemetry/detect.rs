//! Asking an engine what it is: its flavor and how many DP ranks it runs, where the config
//! leaves them out, and its rank count where the config gives one (the engine's count wins).
//!
//! Flavor: SGLang answers `GET /get_server_info` (vLLM has no such route), vLLM `GET /version`;
//! an engine with only a gRPC port is asked vLLM's `GetServerInfo`, then SGLang's.
//! Size: vLLM reports one `engine` label per rank in its `/metrics` (else one entry per rank in
//! `GET /kv_event_sources`), or `GetServerInfo.data_parallel_size` over gRPC; SGLang reports
//! `dp_size` in `/server_info` (older `/get_server_info`) or in `GetServerInfo.server_args`.
//!
//! A member of a multi-server deployment is asked only its flavor (when not configured): what an
//! engine reports as its DP size is the whole deployment's, not the member's share.

use std::collections::BTreeSet;

use serde_json::Value;

use super::client::{fetch, HttpClient};
use super::grpc::Transport;
use super::prom;
use crate::proto::{sglang, vllm};
use crate::worker::{Deployment, Engine, Flavor, Reported};

/// Where a size counted from `/metrics` labels comes from: a count that is only "at least".
const METRICS_LABELS: &str = "/metrics engine labels";

/// What a gRPC-only engine said.
struct GrpcInfo {
    flavor: Flavor,
    dp_size: Option<i64>,
}

/// Asks `engine` what the config leaves to it. `Err` says what was tried and why it failed.
pub async fn detect(
    engine: &Engine,
    http: &HttpClient,
    grpc: &Transport,
) -> Result<Reported, String> {
    let own = engine.deployment == Deployment::Own;
    if !engine.http {
        let info = grpc_info(engine, grpc).await?;
        let dp_size = match own {
            true => Some(size(info.dp_size, "GetServerInfo")?),
            false => None,
        };
        return Ok(Reported {
            flavor: info.flavor,
            dp_size,
            from: "gRPC GetServerInfo",
            at_least: false,
        });
    }
    // SGLang's server info says both its flavor and its size.
    let mut sglang_info = None;
    let flavor = match engine.declared.flavor {
        Some(f) => f,
        None => match get_json(http, engine, "/get_server_info").await {
            Ok(info) => {
                sglang_info = Some(info);
                Flavor::Sglang
            }
            Err(sglang) => match get_json(http, engine, "/version").await {
                Ok(v) if v.get("version").is_some() => Flavor::Vllm,
                Ok(_) => return Err("GET /version answered without a \"version\" key, and GET /get_server_info (SGLang) failed: the flavor is unknown; set `flavor`".into()),
                Err(vllm) => {
                    return Err(format!(
                        "asked its flavor: GET /get_server_info (SGLang): {sglang}; GET /version (vLLM): {vllm}"
                    ))
                }
            },
        },
    };
    if !own {
        return Ok(Reported {
            flavor,
            dp_size: None,
            from: "flavor only (a group member's size is configured)",
            at_least: false,
        });
    }
    let (dp_size, from) = match flavor {
        Flavor::Sglang => {
            let info = match sglang_info {
                Some(i) => i,
                None => match get_json(http, engine, "/server_info").await {
                    Ok(i) => i,
                    Err(_) => get_json(http, engine, "/get_server_info").await?,
                },
            };
            let n = size(
                info.get("dp_size").and_then(Value::as_i64),
                "/server_info dp_size",
            )?;
            (n, "SGLang server info")
        }
        Flavor::Vllm => vllm_ranks(engine, http).await?,
        // Validation gives a gateway its one worker; it is never asked.
        Flavor::Gateway => (1, "gateway"),
    };
    Ok(Reported {
        flavor,
        dp_size: Some(dp_size),
        from,
        at_least: from == METRICS_LABELS,
    })
}

/// A reported size, checked.
fn size(n: Option<i64>, what: &str) -> Result<u32, String> {
    match n {
        Some(n) if (1..=crate::config::MAX_DP_SIZE as i64).contains(&n) => Ok(n as u32),
        Some(n) => Err(format!("{what} is {n}, not a DP size")),
        None => Err(format!("{what} is missing")),
    }
}

/// The ranks a vLLM server labels in `/metrics` (else lists in `/kv_event_sources`). They must
/// be `0..n`: a server labelling 4..7 is one member of a multi-server deployment, which the
/// config must say (`dp_group`, `start_rank = 4`) for its ranks to be read and pinned right.
async fn vllm_ranks(engine: &Engine, http: &HttpClient) -> Result<(u32, &'static str), String> {
    let metrics = fetch_text(http, engine, "/metrics").await;
    let (ranks, from): (BTreeSet<u32>, _) = match &metrics {
        Ok(text) => {
            let scrape = prom::parse(text);
            if !scrape.per_rank.is_empty() {
                (
                    scrape.per_rank.iter().map(|(r, _)| *r).collect(),
                    METRICS_LABELS,
                )
            } else if scrape.unlabelled.is_some() {
                // No DP label at all: one engine.
                return Ok((1, "/metrics (no engine label)"));
            } else {
                (BTreeSet::new(), "")
            }
        }
        Err(_) => (BTreeSet::new(), ""),
    };
    let (ranks, from) = match ranks.is_empty() {
        false => (ranks, from),
        true => {
            let sources = get_json(http, engine, "/kv_event_sources")
                .await
                .map_err(|e| {
                    let m = metrics
                        .as_ref()
                        .err()
                        .cloned()
                        .unwrap_or_else(|| "no KV series".into());
                    format!("asked its DP size: GET /metrics: {m}; GET /kv_event_sources: {e}")
                })?;
            let ranks = (sources.as_object().into_iter().flatten())
                .filter_map(|(k, _)| k.parse().ok())
                .collect::<BTreeSet<u32>>();
            if ranks.is_empty() {
                return Err(
                    "asked its DP size: /metrics labels no rank and /kv_event_sources lists none"
                        .into(),
                );
            }
            (ranks, "/kv_event_sources")
        }
    };
    // A label missing in the middle is a rank without a series yet; one missing at the start is
    // a server that does not number its ranks from 0.
    let (first, last) = (
        ranks.first().copied().unwrap_or(0),
        ranks.last().copied().unwrap_or(0),
    );
    let n = last + 1;
    if n > crate::config::MAX_DP_SIZE {
        return Err(format!("it labels rank {last} ({from}): not a DP rank"));
    }
    if first > 0 {
        let own = last - first + 1;
        return Err(format!(
            "it labels ranks {first}-{last} ({from}), not from 0: it is one member of a multi-server DP deployment; give it dp_group and start_rank = {first} (and dp_size = {own})"
        ));
    }
    Ok((n, from))
}

async fn fetch_text(http: &HttpClient, engine: &Engine, path: &str) -> Result<String, String> {
    let uri: http::Uri = format!("{}{path}", engine.url)
        .parse()
        .map_err(|e| format!("{path}: {e}"))?;
    let body = fetch(http, uri).await.map_err(|f| f.reason)?;
    String::from_utf8(body.to_vec()).map_err(|_| "body is not UTF-8".into())
}

/// GET `path` on the engine as a JSON object.
async fn get_json(http: &HttpClient, engine: &Engine, path: &str) -> Result<Value, String> {
    let text = fetch_text(http, engine, path).await?;
    match serde_json::from_str::<Value>(&text) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err("not a JSON object".into()),
        Err(e) => Err(format!("not JSON: {e}")),
    }
}

/// `GetServerInfo` of the engine's flavor (both, in turn, when the flavor is not configured).
async fn grpc_info(engine: &Engine, transport: &Transport) -> Result<GrpcInfo, String> {
    let origin = engine.grpc_origin();
    let origin: http::Uri =
        (origin.parse()).map_err(|e| format!("gRPC address {origin:?}: {e}"))?;
    let status = |s: tonic::Status| format!("{}: {}", s.code(), s.message());
    let mut tried = Vec::new();
    if engine.declared.flavor.is_none_or(|f| f == Flavor::Vllm) {
        let mut c = vllm::vllm_engine_client::VllmEngineClient::with_origin(
            transport.clone(),
            origin.clone(),
        );
        match c.get_server_info(vllm::GetServerInfoRequest {}).await {
            Ok(r) => {
                return Ok(GrpcInfo {
                    flavor: Flavor::Vllm,
                    dp_size: Some(i64::from(r.into_inner().data_parallel_size)),
                })
            }
            Err(s) => tried.push(format!("vLLM GetServerInfo: {}", status(s))),
        }
    }
    if engine.declared.flavor.is_none_or(|f| f == Flavor::Sglang) {
        let mut c = sglang::sglang_scheduler_client::SglangSchedulerClient::with_origin(
            transport.clone(),
            origin,
        );
        match c.get_server_info(sglang::GetServerInfoRequest {}).await {
            Ok(r) => {
                let args = r.into_inner().server_args.unwrap_or_default();
                let dp_size = args.fields.get("dp_size").and_then(|v| match v.kind {
                    Some(sglang::arg_value::Kind::NumberValue(n)) if n.fract() == 0.0 => {
                        Some(n as i64)
                    }
                    _ => None,
                });
                return Ok(GrpcInfo {
                    flavor: Flavor::Sglang,
                    dp_size,
                });
            }
            Err(s) => tried.push(format!("SGLang GetServerInfo: {}", status(s))),
        }
    }
    Err(format!("asked over gRPC: {}", tried.join("; ")))
}
