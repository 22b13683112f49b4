//! vLLM's disaggregation, NixlConnector in "pull" mode, as vLLM 0.32 serves it (the fixtures in
//! tests/fixtures/vllm-0.32-pd are real bytes of it): P lends the prompt's blocks and names
//! them in `kv_transfer_params`; D pulls them over the rank's side channel.
//!
//! Failure semantics, taken from vLLM:
//! - D's pull fails (P gone, blocks unknown, lease run out): vLLM 0.32's
//!   `kv_transfer_config.kv_load_failure_policy` defaults to `"fail"` (vllm/config/kv_transfer.py;
//!   the default changed from `"recompute"` in vllm-project/vllm#34896), so the scheduler
//!   finishes the request with `FINISHED_ERROR` and the API server answers 500 `Internal server
//!   error` (as the recorded dpP2/prank1 decode did), or an error event in a stream. The sim
//!   never recomputes silently.
//! - P's lease (`kv_lease_duration`, 30 s) runs out: P frees the blocks and counts
//!   `vllm:nixl_num_kv_expired_reqs_total` (the recorded P reports them); a pull that comes
//!   later is refused and counted in `vllm:nixl_num_notifications_after_expiry_total`, and D
//!   counts the failed transfer (and, knowing why, an expired request).
//! - Only non-streaming answers carry `kv_transfer_params`; a streamed P request with
//!   `do_remote_decode` still lends its blocks (vLLM's `request_finished` keeps them whatever the
//!   API does with the params), which nobody can pull: they are held for the lease.
//! - A malformed `kv_transfer_params` is a 400 naming the field (vLLM would fail deeper, with a
//!   KeyError; the 400 is what a router can act on).
//!
//! The side channel is the sim's own: `POST /pull` with `{"remote_engine_id",
//! "remote_request_id", "remote_block_ids"}` on the rank's port, answered 200 `{"num_tokens",
//! "kv_bytes", "dp_rank"}` (the blocks are released), 404 (unknown), 410 (lease run out) or 400.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::{json, Map, Value};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{blocks_of, Got, Leg, PdFail, PdRole};
use crate::sim::prefix::BLOCK_TOKENS;
use crate::sim::rank::Admission;
use crate::sim::{lock, Sim, SimBody};
use rankgate::http::json_response;

/// Largest pull request the side channel reads: ids of a prompt's blocks, far below this.
const MAX_PULL_BYTES: usize = 256 * 1024;
/// Expired request ids remembered to tell "expired" from "unknown".
const EXPIRED_MEMORY: usize = 4096;
/// How long D waits for a pull to be answered: the recorded D gave up on an unreachable P
/// rank after ~30 s.
const PULL_TIMEOUT: Duration = Duration::from_secs(30);
/// vLLM's answer to a request finished with an error, exactly.
const INTERNAL: &str = "Internal server error";

/// What D's params say about the blocks to pull.
#[derive(Debug, Clone)]
pub struct Remote {
    pub engine_id: String,
    pub request_id: String,
    pub block_ids: Vec<u64>,
    pub host: String,
    pub port: u16,
    /// The prompt tokens P computed (older vLLM sent none: the whole prompt then).
    pub num_tokens: Option<u64>,
}

/// One P rank's lent blocks.
#[derive(Debug)]
struct Lease {
    local: usize,
    blocks: Vec<u64>,
    /// KV tokens held on the rank for it.
    tokens: u64,
    /// Prompt tokens whose KV the blocks hold.
    num_tokens: u64,
    until: Instant,
}

/// P's lent blocks, by `remote_request_id`.
#[derive(Debug, Default)]
pub(crate) struct Leases {
    held: Mutex<HashMap<String, Lease>>,
    expired: Mutex<VecDeque<String>>,
    /// Block ids and request id suffixes are numbered from here.
    next: AtomicU64,
    /// Woken when a lease is taken, so the sweeper sees a nearer deadline.
    changed: Arc<Notify>,
}

/// The leg a vLLM request asks of a role server: P lends on `do_remote_decode`, D pulls on
/// `do_remote_prefill`; either flag on the other role, or no params, is an ordinary request.
pub(crate) fn leg(role: PdRole, body: &Value) -> Result<Option<Leg>, (String, String)> {
    let Some(p) = body.get("kv_transfer_params").filter(|p| !p.is_null()) else {
        return Ok(None);
    };
    let Some(p) = p.as_object() else {
        return Err(bad("", format!("must be an object, got {p}")));
    };
    let flag = |k: &str| match p.get(k) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(bad(k, format!("must be a boolean, got {v}"))),
    };
    let (decode, prefill) = (flag("do_remote_decode")?, flag("do_remote_prefill")?);
    match role {
        PdRole::Prefill if decode => Ok(Some(Leg::Lend)),
        PdRole::Decode if prefill => Ok(Some(Leg::Pull(Remote::of(p)?))),
        _ => Ok(None),
    }
}

/// A 400's field (`kv_transfer_params.x`) and message.
fn bad(field: &str, msg: String) -> (String, String) {
    let name = match field {
        "" => "kv_transfer_params".to_string(),
        f => format!("kv_transfer_params.{f}"),
    };
    (name.clone(), format!("{name} {msg}"))
}

impl Remote {
    fn of(p: &Map<String, Value>) -> Result<Remote, (String, String)> {
        let text = |k: &str| match p.get(k) {
            Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
            None | Some(Value::Null) => Err(bad(k, "is missing".into())),
            Some(v) => Err(bad(k, format!("must be a non-empty string, got {v}"))),
        };
        let port = match p.get("remote_port") {
            Some(v) => v
                .as_u64()
                .and_then(|n| u16::try_from(n).ok())
                .filter(|n| *n > 0)
                .ok_or_else(|| {
                    bad(
                        "remote_port",
                        format!("must be a port (1..=65535), got {v}"),
                    )
                })?,
            None => return Err(bad("remote_port", "is missing".into())),
        };
        let num_tokens = match p.get("remote_num_tokens") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                bad(
                    "remote_num_tokens",
                    format!("must be a non-negative integer, got {v}"),
                )
            })?),
        };
        Ok(Remote {
            engine_id: text("remote_engine_id")?,
            request_id: text("remote_request_id")?,
            block_ids: block_ids(p.get("remote_block_ids"))?,
            host: text("remote_host")?,
            port,
            num_tokens,
        })
    }
}

/// `remote_block_ids`: one list per KV cache group (`[[1, 2, 3]]`), or one flat list as older
/// vLLM sent it; flattened.
fn block_ids(v: Option<&Value>) -> Result<Vec<u64>, (String, String)> {
    let wrong = |v: &Value| {
        bad(
            "remote_block_ids",
            format!("must be a list of lists of block ids, got {v}"),
        )
    };
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Err(bad("remote_block_ids", "is missing".into()));
    };
    let groups = v.as_array().ok_or_else(|| wrong(v))?;
    let mut ids = Vec::new();
    for g in groups {
        match g {
            Value::Array(inner) => {
                for id in inner {
                    ids.push(id.as_u64().ok_or_else(|| wrong(v))?);
                }
            }
            id => ids.push(id.as_u64().ok_or_else(|| wrong(v))?),
        }
    }
    Ok(ids)
}

impl Sim {
    /// vLLM's engine id for a local rank: `<engine_id>_dp<rank>` in a DP deployment.
    fn rank_engine_id(&self, local: usize) -> String {
        if self.cfg.deployment_size() > 1 {
            format!("{}_dp{}", self.pd.engine_id, self.ranks[local].global)
        } else {
            self.pd.engine_id.clone()
        }
    }

    /// P lends the finished request's prompt blocks for the lease and returns the params that
    /// name them. `id` is the response id (`chatcmpl-...`, `cmpl-...`).
    pub(super) fn lend(
        &self,
        local: usize,
        id: &str,
        prompt_tokens: u64,
        adm: &Admission<'_>,
    ) -> Value {
        let leases = &self.pd.leases;
        let (nblocks, _) = blocks_of(prompt_tokens);
        let n = leases.next.fetch_add(nblocks.max(1), Relaxed);
        let blocks: Vec<u64> = (n + 1..=n + nblocks).collect();
        // vLLM's internal id: the response id, `-0` per prompt for completions, 8 hex digits.
        let sep = if id.starts_with("cmpl-") { "-0-" } else { "-" };
        let request_id = format!(
            "{id}{sep}{:08x}",
            ((n + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as u32
        );
        let tokens = nblocks * BLOCK_TOKENS;
        // Held before the request's own admission is dropped, so the KV never looks free.
        self.ranks[local].hold_kv(tokens, false);
        let c = &self.pd.ranks[local];
        c.held_leases.fetch_add(1, Relaxed);
        c.held_tokens.fetch_add(tokens, Relaxed);
        let lease = Lease {
            local,
            blocks: blocks.clone(),
            tokens,
            num_tokens: prompt_tokens,
            until: Instant::now() + self.cfg.pd.kv_lease,
        };
        lock(&leases.held).insert(request_id.clone(), lease);
        leases.changed.notify_one();
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": [blocks],
            "remote_engine_id": self.rank_engine_id(local),
            "remote_request_id": request_id,
            "remote_host": self.cfg.pd.side_host,
            "remote_port": self.pd.side_ports.get(local).copied().unwrap_or(0),
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt_tokens,
            "remote_blocks_expiry_time": null,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": adm.cached_tokens,
        })
    }

    /// Frees a lease's blocks and stops counting it.
    fn release(&self, lease: &Lease) {
        self.ranks[lease.local].hold_kv(lease.tokens, true);
        let c = &self.pd.ranks[lease.local];
        c.held_leases.fetch_sub(1, Relaxed);
        c.held_tokens.fetch_sub(lease.tokens, Relaxed);
    }

    /// Releases every lease whose time is up (counted as expired); returns the next deadline.
    fn expire_due(&self) -> Option<Instant> {
        let now = Instant::now();
        let mut held = lock(&self.pd.leases.held);
        let due: Vec<String> = (held.iter())
            .filter(|(_, l)| l.until <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for id in due {
            if let Some(lease) = held.remove(&id) {
                self.release(&lease);
                self.pd.ranks[lease.local].expired.fetch_add(1, Relaxed);
                let mut expired = lock(&self.pd.leases.expired);
                if expired.len() == EXPIRED_MEMORY {
                    expired.pop_front();
                }
                expired.push_back(id);
            }
        }
        held.values().map(|l| l.until).min()
    }

    /// D pulls the blocks its params name from P's side channel.
    pub(super) async fn pull(
        &self,
        local: usize,
        remote: &Remote,
        prompt_tokens: u64,
    ) -> Result<Got, PdFail> {
        let url = format!("http://{}:{}/pull", remote.host, remote.port);
        let body = json!({"remote_engine_id": remote.engine_id,
            "remote_request_id": remote.request_id, "remote_block_ids": remote.block_ids});
        let c = &self.pd.ranks[local];
        let fail = |why: String| {
            tracing::debug!(url = %url, why = %why, "sim KV pull failed");
            c.failed.fetch_add(1, Relaxed);
            PdFail {
                message: INTERNAL.into(),
            }
        };
        match super::call(
            self.pd_client(),
            Method::POST,
            &url,
            Some(body),
            PULL_TIMEOUT,
        )
        .await
        {
            Ok((StatusCode::OK, v)) => Ok(Got {
                tokens: (remote.num_tokens)
                    .or_else(|| v["num_tokens"].as_u64())
                    .unwrap_or(prompt_tokens)
                    .min(prompt_tokens),
                bytes: v["kv_bytes"].as_u64().unwrap_or(0),
            }),
            Ok((StatusCode::GONE, v)) => {
                c.expired.fetch_add(1, Relaxed);
                Err(fail(format!("lease expired: {v}")))
            }
            Ok((status, v)) => Err(fail(format!("{status}: {v}"))),
            Err(e) => Err(fail(e)),
        }
    }
}

/// Releases expired leases on time until the engine goes: one task per vLLM P, holding the
/// engine only weakly so that a dropped engine is not kept alive by its sweeper.
pub(super) async fn sweep(sim: std::sync::Weak<Sim>, changed: Arc<Notify>) {
    loop {
        let next = match sim.upgrade() {
            Some(s) => s.expire_due(),
            None => return,
        };
        // With no lease, wake at least every minute to notice the engine is gone.
        let until = next.unwrap_or_else(|| Instant::now() + Duration::from_secs(60));
        tokio::select! {
            _ = tokio::time::sleep_until(until) => {}
            _ = changed.notified() => {}
        }
    }
}

/// Starts the lease sweeper of a vLLM P.
pub(super) fn start_sweeper(sim: &Arc<Sim>) {
    tokio::spawn(sweep(Arc::downgrade(sim), sim.pd.leases.changed.clone()));
}

/// One P rank's side channel: D's pull releases the blocks it names and learns their size.
pub(super) async fn side_channel(
    sim: Arc<Sim>,
    local: usize,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, Infallible> {
    let answer = |status: StatusCode, v: Value| Ok(json_response(status, &v));
    if (req.method(), req.uri().path()) != (&Method::POST, "/pull") {
        return answer(StatusCode::NOT_FOUND, json!({"error": "no such route"}));
    }
    let body = match Limited::new(req.into_body(), MAX_PULL_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => return answer(StatusCode::BAD_REQUEST, json!({"error": e.to_string()})),
    };
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return answer(StatusCode::BAD_REQUEST, json!({"error": e.to_string()})),
    };
    let (Some(id), Some(engine)) = (
        v["remote_request_id"].as_str(),
        v["remote_engine_id"].as_str(),
    ) else {
        return answer(
            StatusCode::BAD_REQUEST,
            json!({"error": "remote_request_id and remote_engine_id are required"}),
        );
    };
    if engine != sim.rank_engine_id(local) {
        return answer(
            StatusCode::NOT_FOUND,
            json!({"error": format!("this side channel serves {}, not {engine}", sim.rank_engine_id(local))}),
        );
    }
    let asked: Vec<u64> = (v["remote_block_ids"].as_array().into_iter().flatten())
        .filter_map(Value::as_u64)
        .collect();
    let lease = {
        let mut held = lock(&sim.pd.leases.held);
        match held.get(id) {
            Some(l) if l.local == local && l.blocks == asked => held.remove(id),
            Some(_) => {
                return answer(
                    StatusCode::BAD_REQUEST,
                    json!({"error": "the blocks named are not the request's"}),
                )
            }
            None => None,
        }
    };
    match lease {
        Some(lease) => {
            sim.release(&lease);
            let (_, bytes) = blocks_of(lease.num_tokens);
            answer(
                StatusCode::OK,
                json!({"num_tokens": lease.num_tokens, "kv_bytes": bytes,
                    "dp_rank": sim.ranks[local].global}),
            )
        }
        None if lock(&sim.pd.leases.expired).iter().any(|e| e == id) => {
            sim.pd.ranks[local].after_expiry.fetch_add(1, Relaxed);
            answer(
                StatusCode::GONE,
                json!({"error": format!("{id}: lease expired")}),
            )
        }
        None => answer(
            StatusCode::NOT_FOUND,
            json!({"error": format!("{id}: no such request")}),
        ),
    }
}
