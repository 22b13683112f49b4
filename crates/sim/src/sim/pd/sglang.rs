//! SGLang's disaggregation, as its source defines it (python/sglang/srt/disaggregation/ and the
//! router's PD request): the router sends the same body to P and D at once with
//! `bootstrap_host`, `bootstrap_port` (P's `--disaggregation-bootstrap-port`) and
//! `bootstrap_room` (an integer, 0 <= room < 2^63); only D's answer reaches the client.
//!
//! Which ranks: P's DP rank is the body's `data_parallel_rank` when given, else
//! `bootstrap_room % dp_size` (`DataParallelController.follow_bootstrap_room_scheduler`,
//! python/sglang/srt/managers/data_parallel_controller.py). D looks for the room's KV on P
//! rank `disagg_prefill_dp_rank` when given, else 0 for a P without DP, else
//! `bootstrap_room % P's dp_size` (`DecodePreallocQueue._resolve_prefill_dp_rank`,
//! python/sglang/srt/disaggregation/decode.py). A router that pins P elsewhere than the room
//! says, without telling D, leaves D waiting for KV that never comes: as with SGLang.
//!
//! Timing and failures: P prefills, answers with its one token only once its D took the
//! room's KV, and fails (500) when none comes within `bootstrap_timeout`
//! (`SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`, 300 s); D waits for the KV at most
//! `waiting_timeout` (`SGLANG_DISAGGREGATION_WAITING_TIMEOUT`, 300 s) and then fails with a 500,
//! as SGLang aborts a request whose KV poll failed with `INTERNAL_SERVER_ERROR`. A role server
//! given no `bootstrap_room` answers 400 with the message of the assertion SGLang fails on
//! (which there takes the DP controller down); malformed fields are 400s naming the field, as
//! SGLang's request model validates them.
//!
//! The bootstrap server speaks the sim's own protocol: `GET /sim/prefill_info` (`{"dp_size"}`)
//! and `POST /sim/kv` `{"room", "dp_rank", "wait_ms"}`, answered once the room's KV is ready
//! on that rank (200 `{"num_tokens", "kv_bytes", "dp_rank"}`) or when the wait ends (408).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::sync::{oneshot, Notify};

use super::{blocks_of, Got, Leg, PdFail, PdRole};
use crate::sim::{lock, Sim, SimBody};
use rankgate::http::json_response;

/// Largest request the bootstrap server reads.
const MAX_BOOTSTRAP_BYTES: usize = 16 * 1024;
/// Longest a D's ask may wait on the bootstrap server, whatever it asks for.
const MAX_WAIT: Duration = Duration::from_secs(3600);
/// How long D waits for P's bootstrap server to say its DP size.
const INFO_TIMEOUT: Duration = Duration::from_secs(10);
/// Rooms are 63-bit (the router draws them below 2^63).
const ROOM_LIMIT: u64 = 1 << 63;

/// A request's bootstrap fields.
#[derive(Debug, Clone)]
pub struct Room {
    pub room: u64,
    pub host: Option<String>,
    pub port: Option<u16>,
    /// `disagg_prefill_dp_rank`: which P rank D looks on, when the router says.
    pub prefill_rank: Option<u64>,
}

/// A prefilled room waiting for its D.
#[derive(Debug)]
struct Ready {
    local: usize,
    tokens: u64,
    taken: oneshot::Sender<()>,
}

/// P's prefilled rooms, by room.
#[derive(Debug, Default)]
pub(crate) struct Rooms {
    ready: Mutex<HashMap<u64, Ready>>,
    /// Woken when a room is ready.
    changed: Notify,
}

/// Takes a room off the ready ones when dropped (rooms are random 63-bit numbers, one a
/// request, so the room's entry is the request's own).
struct Forget<'a>(&'a Rooms, u64);

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        lock(&self.0.ready).remove(&self.1);
    }
}

/// The leg a SGLang request asks of a role server: P sends, D receives.
pub(crate) fn leg(role: PdRole, body: &Value) -> Result<Option<Leg>, (String, String)> {
    let field = |k: &str| body.get(k).filter(|v| !v.is_null());
    let room = match field("bootstrap_room") {
        None => {
            return Err((
                "bootstrap_room".into(),
                "bootstrap_room should not be None. Do not send requests directly to prefill \
                 or decode instances; send to the router instead."
                    .into(),
            ))
        }
        Some(v) => v.as_u64().filter(|r| *r < ROOM_LIMIT).ok_or_else(|| {
            (
                "bootstrap_room".to_string(),
                format!("bootstrap_room must be an integer in [0, 2^63), got {v}"),
            )
        })?,
    };
    let host = match field("bootstrap_host") {
        None => None,
        Some(Value::String(h)) if !h.is_empty() => Some(h.clone()),
        Some(v) => return Err(wrong("bootstrap_host", "a host name", v)),
    };
    let port = match field("bootstrap_port") {
        None => None,
        Some(v) => Some(
            (v.as_u64().and_then(|p| u16::try_from(p).ok()))
                .filter(|p| *p > 0)
                .ok_or_else(|| wrong("bootstrap_port", "a port (1..=65535)", v))?,
        ),
    };
    let prefill_rank = match field("disagg_prefill_dp_rank") {
        None => None,
        Some(v) => Some(
            v.as_u64()
                .ok_or_else(|| wrong("disagg_prefill_dp_rank", "a rank", v))?,
        ),
    };
    let r = Room {
        room,
        host,
        port,
        prefill_rank,
    };
    Ok(Some(match role {
        PdRole::Prefill => Leg::Send(r),
        PdRole::Decode => {
            // D must know where P's bootstrap server is.
            for (k, missing) in [
                ("bootstrap_host", r.host.is_none()),
                ("bootstrap_port", r.port.is_none()),
            ] {
                if missing {
                    return Err((k.into(), format!("{k} is required on a decode server")));
                }
            }
            Leg::Receive(r)
        }
    }))
}

fn wrong(field: &str, what: &str, v: &Value) -> (String, String) {
    (field.into(), format!("{field} must be {what}, got {v}"))
}

impl Sim {
    /// P hands the room's KV to its D: the room is ready on this rank until a D takes it
    /// (then P answers) or `bootstrap_timeout` passes (then P fails). The request's KV stays
    /// held meanwhile, as P holds the blocks until they are sent.
    pub(super) async fn send(&self, local: usize, room: &Room, tokens: u64) -> Result<(), PdFail> {
        let (tx, rx) = oneshot::channel();
        // Whatever ends the wait (taken, timed out, the client gone), the room goes with it.
        let _gone = Forget(&self.pd.rooms, room.room);
        lock(&self.pd.rooms.ready).insert(
            room.room,
            Ready {
                local,
                tokens,
                taken: tx,
            },
        );
        self.pd.rooms.changed.notify_waiters();
        let wait = self.cfg.pd.bootstrap_timeout;
        match tokio::time::timeout(wait, rx).await {
            Ok(Ok(())) => Ok(()),
            _ => {
                self.pd.ranks[local].failed.fetch_add(1, Relaxed);
                Err(PdFail {
                    message: format!(
                        "Request {} timed out after {:.1}s waiting for its decode server \
                         (bootstrap timeout)",
                        room.room,
                        wait.as_secs_f64()
                    ),
                })
            }
        }
    }

    /// D gets the room's KV from P's bootstrap server, waiting at most `waiting_timeout`.
    pub(super) async fn receive(
        &self,
        local: usize,
        room: &Room,
        prompt_tokens: u64,
    ) -> Result<Got, PdFail> {
        let wait = self.cfg.pd.waiting_timeout;
        let fail = |why: String| {
            self.pd.ranks[local].failed.fetch_add(1, Relaxed);
            PdFail {
                message: format!(
                    "Decode transfer failed for request bootstrap_room={}: {why}",
                    room.room
                ),
            }
        };
        let base = format!(
            "http://{}:{}",
            room.host.as_deref().unwrap_or("127.0.0.1"),
            room.port.unwrap_or(0)
        );
        let info = super::call(
            self.pd_client(),
            Method::GET,
            &format!("{base}/sim/prefill_info"),
            None,
            INFO_TIMEOUT,
        )
        .await
        .map_err(|e| fail(format!("bootstrap server unreachable: {e}")))?;
        let dp_size = info.1["dp_size"].as_u64().unwrap_or(1).max(1);
        let target = match room.prefill_rank {
            Some(r) => r,
            None if dp_size == 1 => 0,
            None => room.room % dp_size,
        };
        let ask = json!({"room": room.room, "dp_rank": target, "wait_ms": wait.as_millis() as u64});
        // The bootstrap server answers when the wait ends; a margin lets its answer arrive.
        let margin = Duration::from_secs(5);
        match super::call(
            self.pd_client(),
            Method::POST,
            &format!("{base}/sim/kv"),
            Some(ask),
            wait + margin,
        )
        .await
        {
            Ok((StatusCode::OK, v)) => Ok(Got {
                tokens: v["num_tokens"].as_u64().unwrap_or(0).min(prompt_tokens),
                bytes: v["kv_bytes"].as_u64().unwrap_or(0),
            }),
            Ok((StatusCode::REQUEST_TIMEOUT, _)) => Err(fail(format!(
                "Request {} timed out after {:.1}s in KVPoll.WaitingForInput",
                room.room,
                wait.as_secs_f64()
            ))),
            Ok((status, v)) => Err(fail(format!("{status}: {v}"))),
            Err(e) => Err(fail(format!("bootstrap server: {e}"))),
        }
    }

    /// Takes room `room` off P rank `local` once it is ready, waiting at most `wait`.
    async fn take_room(&self, room: u64, local: usize, wait: Duration) -> Option<u64> {
        let deadline = tokio::time::Instant::now() + wait.min(MAX_WAIT);
        loop {
            let notified = self.pd.rooms.changed.notified();
            tokio::pin!(notified);
            // Registered before looking, so a room made ready in between is not missed.
            notified.as_mut().enable();
            {
                let mut ready = lock(&self.pd.rooms.ready);
                if ready.get(&room).is_some_and(|r| r.local == local) {
                    if let Some(r) = ready.remove(&room) {
                        // P's request may have timed out just now: then nothing was sent.
                        if r.taken.send(()).is_ok() {
                            return Some(r.tokens);
                        }
                    }
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }
}

/// P's bootstrap server.
pub(super) async fn bootstrap_server(
    sim: Arc<Sim>,
    req: Request<Incoming>,
) -> Result<Response<SimBody>, Infallible> {
    let answer = |status: StatusCode, v: Value| Ok(json_response(status, &v));
    match (req.method().clone(), req.uri().path()) {
        (Method::GET, "/health") => return answer(StatusCode::OK, json!({})),
        (Method::GET, "/sim/prefill_info") => {
            return answer(
                StatusCode::OK,
                json!({"dp_size": sim.cfg.dp_size,
                "follow_bootstrap_room": true}),
            )
        }
        (Method::POST, "/sim/kv") => {}
        _ => return answer(StatusCode::NOT_FOUND, json!({"error": "no such route"})),
    }
    let v: Value = match Limited::new(req.into_body(), MAX_BOOTSTRAP_BYTES)
        .collect()
        .await
    {
        Ok(b) => serde_json::from_slice(&b.to_bytes()).unwrap_or(Value::Null),
        Err(_) => Value::Null,
    };
    let (Some(room), Some(rank), Some(wait)) = (
        v["room"].as_u64(),
        v["dp_rank"].as_u64(),
        v["wait_ms"].as_u64(),
    ) else {
        return answer(
            StatusCode::BAD_REQUEST,
            json!({"error": "room, dp_rank and wait_ms are required integers"}),
        );
    };
    if rank >= u64::from(sim.cfg.dp_size) {
        return answer(
            StatusCode::BAD_REQUEST,
            json!({"error": format!("dp_rank {rank} is out of range [0, {})", sim.cfg.dp_size)}),
        );
    }
    let local = rank as usize;
    match sim
        .take_room(room, local, Duration::from_millis(wait))
        .await
    {
        Some(tokens) => {
            let (_, bytes) = blocks_of(tokens);
            answer(
                StatusCode::OK,
                json!({"num_tokens": tokens, "kv_bytes": bytes, "dp_rank": sim.ranks[local].global}),
            )
        }
        None => answer(
            StatusCode::REQUEST_TIMEOUT,
            json!({"error": format!("room {room} not ready on rank {rank}")}),
        ),
    }
}
