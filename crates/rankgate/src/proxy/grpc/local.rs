//! The calls the gRPC front door answers itself: `GetLoads` from the snapshot, the standard
//! health service for rankgate, and the two calls that go to chosen engines rather than to a
//! picked rank: `Abort` (to the engine holding each request id) and `FlushCache` (to all).

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::uri::{PathAndQuery, Scheme};
use http::{Request, Uri, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use prost::Message;
use tokio::time::Instant;
use tonic::Code;

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

use super::answer::{ok_response, Answer};
use super::calls::{frame, one_message, strings, HEALTH_SERVICE, SGLANG_SERVICE, VLLM_SERVICE};
use super::requests::Requests;
use crate::policy::{self, Avoid, Front};
use crate::proto::health::{health_check_response::ServingStatus, HealthCheckRequest};
use crate::proto::{health, sglang, vllm};
use crate::proxy::dial::Dial;
use crate::proxy::error::{GrpcError, ProxyError};
use crate::proxy::layer::{content_length, Answer as Answered};
use crate::proxy::pin::strip_hop_by_hop;
use crate::proxy::read::{self, Limits};
use crate::proxy::shared::Ctx;
use crate::table::Load;
use crate::upstream::RequestBody;
use crate::worker::{EngineEntry, Flavor};

/// What the calls rankgate answers itself need, one for the router.
#[derive(Debug)]
pub struct Local {
    /// In-flight request ids and their engines (for Abort; `track` enters them).
    pub requests: Arc<Requests>,
    /// Shutdown has begun: the health service says NOT_SERVING.
    pub draining: Arc<AtomicBool>,
    /// How a request message is read.
    pub limits: Limits,
    /// How Abort and FlushCache reach the engines.
    pub dial: Arc<Dial>,
}

/// The ranks a gRPC call of `flavor` may go to: those of engines of the flavor with a
/// `grpc_url`; `None` when the fleet has no such engine now.
pub fn targets(ctx: &Ctx, flavor: Flavor) -> Option<Avoid> {
    let front = policy::Front::Grpc(flavor);
    let snap = ctx.table.snapshot.load();
    (snap.fleet.engines.iter())
        .any(|e| front.served_by(e))
        .then(|| Avoid::front(front))
}

/// Whether the front door is ready for new gRPC calls of `flavor` (`None`: all of them): not
/// shutting down, and a rank to send them to.
fn serving(ctx: &Ctx, local: &Local, flavor: Option<Flavor>) -> bool {
    if local.draining.load(Relaxed) {
        return false;
    }
    let all = [Flavor::Vllm, Flavor::Sglang];
    let flavors = match flavor {
        Some(f) => std::slice::from_ref(&all[(f == Flavor::Sglang) as usize]),
        None => &all[..],
    };
    flavors.iter().any(|f| {
        targets(ctx, *f).is_some_and(|avoid| ctx.selector.any_routable(&ctx.table, &avoid))
    })
}

/// The request's one message, read whole (under `server.max_body_bytes`).
async fn message(
    limits: Limits,
    req: Request<Incoming>,
) -> Result<(http::request::Parts, Bytes), ProxyError> {
    let max = limits.max_body;
    let length = content_length(req.headers());
    if length.is_some_and(|n| n > max as u64) {
        return Err(ProxyError::TooLarge(max));
    }
    let (parts, body) = req.into_parts();
    let body = match read::read(body, length, max, max, limits.pace()).await? {
        RequestBody::Full(b) => b,
        RequestBody::Stream(_) => return Err(ProxyError::TooLarge(max)),
    };
    let m = Bytes::copy_from_slice(one_message(&body)?);
    Ok((parts, m))
}

fn decode<M: Message + Default>(m: &[u8]) -> Result<M, ProxyError> {
    M::decode(m)
        .map_err(|e| GrpcError::new(Code::InvalidArgument, format!("request message: {e}")).into())
}

/// `grpc.health.v1.Health/Check`: SERVING while rankgate takes calls for the service (`""`: any)
/// and has a rank to send them to; NOT_FOUND for a service it does not front.
pub async fn health(ctx: Ctx, local: Arc<Local>, req: Request<Incoming>) -> Answered {
    let method = req
        .uri()
        .path()
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_owned();
    if method != "Check" {
        return Err(GrpcError::new(
            Code::Unimplemented,
            format!("method /{HEALTH_SERVICE}/{method} is not served (Check is)"),
        )
        .into());
    }
    let (_, m) = message(local.limits, req).await?;
    let service = decode::<HealthCheckRequest>(&m)?.service;
    let flavor = match service.as_str() {
        "" => None,
        VLLM_SERVICE => Some(Flavor::Vllm),
        SGLANG_SERVICE => Some(Flavor::Sglang),
        other => {
            return Err(GrpcError::new(Code::NotFound, format!("unknown service {other:?}")).into())
        }
    };
    let status = match serving(&ctx, &local, flavor) {
        true => ServingStatus::Serving,
        false => ServingStatus::NotServing,
    };
    let reply = health::HealthCheckResponse {
        status: status as i32,
    };
    Ok(ok_response(&reply.encode_to_vec()))
}

fn clamp(n: u64) -> i32 {
    n.min(i32::MAX as u64) as i32
}

/// A rank's entry in a `GetLoads` answer.
trait Entry {
    fn of(rank: u32, l: &Load) -> Self;
}

// The two services' entries differ only in one field number, so one body builds both.
macro_rules! impl_entry {
    ($ty:ty) => {
        impl Entry for $ty {
            fn of(rank: u32, l: &Load) -> Self {
                let (running, waiting) = (l.running.unwrap_or(0), l.waiting.unwrap_or(0));
                Self {
                    dp_rank: clamp(rank.into()),
                    num_running_reqs: clamp(running.into()),
                    num_waiting_reqs: clamp(waiting.into()),
                    num_total_reqs: clamp(u64::from(running) + u64::from(waiting)),
                    num_used_tokens: clamp(l.used_tokens.unwrap_or(0)),
                    max_total_num_tokens: clamp(l.capacity_tokens.unwrap_or(0)),
                    token_usage: l.kv_usage,
                    ..Self::default()
                }
            }
        }
    };
}
impl_entry!(vllm::SchedulerLoad);
impl_entry!(sglang::SchedulerLoad);

/// `GetLoads`, answered from the snapshot: one entry per rank of the flavor's gRPC engines that
/// has fresh numbers (a rank without is left out, never zero-filled), in global numbering.
pub async fn get_loads(
    ctx: Ctx,
    local: Arc<Local>,
    flavor: Flavor,
    req: Request<Incoming>,
) -> Answered {
    let (_, m) = message(local.limits, req).await?;
    // Field 1 in both services' requests, `optional` in both.
    let filter = decode::<vllm::GetLoadsRequest>(&m)?.dp_rank;
    let table = &ctx.table;
    let snap = table.snapshot.load();
    let now = Instant::now();
    let mut managed = 0;
    let mut fresh = Vec::new();
    for (w, worker) in snap.fleet.workers.iter_enumerated() {
        let engine = &snap.fleet.engines[worker.engine];
        let (Some(rank), true) = (
            worker.id.rank,
            engine.flavor == flavor && engine.grpc.is_some(),
        ) else {
            continue;
        };
        if filter.is_some_and(|f| i64::from(f) != i64::from(rank)) {
            continue;
        }
        managed += 1;
        if let Some(l) = snap.ranks[w].telemetry.fresh(now, table.stale_after) {
            fresh.push((rank, l));
        }
    }
    if let (Some(f), 0) = (filter, managed) {
        return Err(GrpcError::new(
            Code::InvalidArgument,
            format!("dp_rank {f} is not a rank rankgate routes {flavor} gRPC calls to"),
        )
        .into());
    }
    let version = concat!("rankgate ", env!("CARGO_PKG_VERSION")).to_string();
    let reply = match flavor {
        Flavor::Sglang => sglang::GetLoadsResponse {
            version,
            dp_rank_count: managed,
            loads: fresh.iter().map(|(r, l)| Entry::of(*r, l)).collect(),
            ..Default::default()
        }
        .encode_to_vec(),
        _ => vllm::GetLoadsResponse {
            version,
            dp_rank_count: managed,
            loads: fresh.iter().map(|(r, l)| Entry::of(*r, l)).collect(),
            ..Default::default()
        }
        .encode_to_vec(),
    };
    Ok(ok_response(&reply))
}

/// Sends one unary call to engine `e` and reads its whole answer (within
/// `server.response_timeout`).
async fn call_engine(
    dial: &Dial,
    engine: &EngineEntry,
    parts: &http::request::Parts,
    message: &[u8],
) -> Result<Answer, ProxyError> {
    let upstream = |reason: String| ProxyError::Upstream {
        engine: engine.url.clone(),
        reason,
    };
    let mut headers = parts.headers.clone();
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    headers.insert(header::TE, HeaderValue::from_static("trailers"));
    if let Some(key) = &engine.api_key {
        headers.insert(header::AUTHORIZATION, key.0.clone());
    }
    let mut uri = http::uri::Parts::default();
    uri.scheme = Some(Scheme::HTTP);
    uri.authority = engine.conn.grpc_authority.clone();
    uri.path_and_query = parts
        .uri
        .path_and_query()
        .cloned()
        .or(Some(PathAndQuery::from_static("/")));
    let uri =
        Uri::from_parts(uri).map_err(|err| ProxyError::Internal(format!("building URI: {err}")))?;
    let mut req = Request::new(RequestBody::Full(frame(message)));
    *req.uri_mut() = uri;
    *req.method_mut() = http::Method::POST;
    *req.version_mut() = Version::HTTP_2;
    *req.headers_mut() = headers;
    let timeout = dial.response;
    let exchange = async {
        let resp = dial.grpc_clients[0]
            .request(req)
            .await
            .map_err(|err| upstream(crate::http::error_chain(&err)))?;
        let (mut head, body) = resp.into_parts();
        strip_hop_by_hop(&mut head.headers);
        let all = body
            .collect()
            .await
            .map_err(|err| upstream(crate::http::error_chain(&err)))?;
        let trailers = all.trailers().cloned().unwrap_or_default();
        Ok(Answer {
            headers: head.headers,
            body: all.to_bytes(),
            trailers,
        })
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| GrpcError {
            setting: Some("server.response_timeout"),
            ..GrpcError::new(
                Code::DeadlineExceeded,
                format!(
                    "the engine sent no answer within {} ms",
                    timeout.as_millis()
                ),
            )
            .on(&engine.url)
        })?
}

/// An engine's answer that is not OK, as the error the client gets: the engine's own status,
/// with the engine named.
fn engine_status(engine: &EngineEntry, answer: &Answer) -> Option<ProxyError> {
    let (code, message) = answer.status();
    (code != Code::Ok).then(|| GrpcError::new(code, message).on(&engine.url).into())
}

/// `Abort`: each request id goes to the engine that holds it (vLLM's request lists several, and
/// each engine gets its own, every other field as sent); ids rankgate does not know are done.
pub async fn abort(local: Arc<Local>, flavor: Flavor, req: Request<Incoming>) -> Answered {
    let (parts, m) = message(local.limits, req).await?;
    // vLLM: `repeated string request_ids = 1`; SGLang: `string request_id = 1`. Both field 1.
    let mut engines: Vec<Arc<EngineEntry>> = strings(&m, 1)?
        .into_iter()
        .filter_map(|id| local.requests.engine_of(id))
        .collect();
    engines.sort_unstable_by_key(|e| e.key);
    engines.dedup_by_key(|e| e.key);
    let mut first = None;
    for e in engines {
        let only_its_own = match flavor {
            Flavor::Sglang => m.to_vec(),
            _ => crate::pbwire::without(&m, |f, bytes| {
                f == 1
                    && crate::pbwire::payload(bytes)
                        .and_then(|p| std::str::from_utf8(p).ok())
                        .is_none_or(|id| local.requests.engine_of(id).map(|o| o.key) != Some(e.key))
            })
            .map_err(|err| {
                GrpcError::new(Code::InvalidArgument, format!("request message: {err}"))
            })?,
        };
        let answer = call_engine(&local.dial, &e, &parts, &only_its_own).await?;
        if let Some(err) = engine_status(&e, &answer) {
            return Err(err);
        }
        first.get_or_insert(answer);
    }
    Ok(match (first, flavor) {
        (Some(answer), _) => answer.into_response(),
        // Nothing runs under these ids any more: done, which SGLang's answer says in a field.
        (None, Flavor::Sglang) => ok_response(
            &sglang::AbortResponse {
                success: true,
                message: String::new(),
            }
            .encode_to_vec(),
        ),
        (None, _) => ok_response(&[]),
    })
}

/// `FlushCache`: to every engine of the flavor with a gRPC address; fails with the first engine
/// that fails, else answers as the first engine did.
pub async fn flush_cache(
    ctx: Ctx,
    local: Arc<Local>,
    flavor: Flavor,
    req: Request<Incoming>,
) -> Answered {
    let (parts, m) = message(local.limits, req).await?;
    let engines: Vec<Arc<EngineEntry>> = (ctx.table.snapshot.load().fleet.engines.iter())
        .filter(|e| Front::Grpc(flavor).served_by(e))
        .cloned()
        .collect();
    let mut calls = tokio::task::JoinSet::new();
    for (i, e) in engines.iter().enumerate() {
        let (local, parts, m, e) = (local.clone(), parts.clone(), m.clone(), e.clone());
        calls.spawn(async move {
            let answer = call_engine(&local.dial, &e, &parts, &m).await;
            (i, e, answer)
        });
    }
    let mut answers: Vec<Option<Answer>> = (0..engines.len()).map(|_| None).collect();
    while let Some(done) = calls.join_next().await {
        let (i, e, answer) = done.map_err(|err| ProxyError::Internal(err.to_string()))?;
        let answer = answer?;
        if let Some(err) = engine_status(&e, &answer) {
            return Err(err);
        }
        answers[i] = Some(answer);
    }
    match answers.into_iter().flatten().next() {
        Some(answer) => Ok(answer.into_response()),
        None => Ok(ok_response(&[])),
    }
}
