//! The admin listener: `/health`, `/ready`, `/workers`, `/engines`, `/loads`, `/flows`, `/routes`
//! and `/metrics`, all answered from the cached snapshot and counters (no admin call ever reaches
//! an engine), and the fleet's changes: `POST /engines`, `DELETE /engines?url=...` and
//! `POST /reload`, which need the admin token (`server.admin_token_env`; else refused).
//!
//! `/ready` and `/health` are answered on the connection's own task from the snapshot, taking
//! no lock; the fleet-wide renders run off the runtime's threads, a couple at a time
//! ([`render::RENDERS_AT_ONCE`]), and the mutations wait on their own, so neither can hold a probe up.
//!
//! `/loads` speaks the fleet-rollup shape of an upstream gateway (entries annotated with
//! `worker`, `dp_rank` = global rank, an `aggregate`), so one rankgate can front others.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use http_body_util::Full;
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::config::{RawEngine, SourceKind};
use crate::control::{Control, Refusal, ReloadError};
use crate::http::{json_response, openai_error, respond};
use crate::membership::{Change, MembershipError};
use crate::metrics::Metrics;
use crate::policy::Selector;
use crate::proxy::Denied;
use crate::reason::Reason;
use crate::table::{Fresh, RankTelemetry, Table};
use crate::worker::{Deployment, Flavor};
use query::query_param;
use render::off_runtime;
pub use render::Renders;

mod adapters;
mod failures;
mod query;
mod reach;
mod ready;
mod render;
mod routes;
mod rows;

/// What the admin handlers read.
pub struct Admin {
    pub table: Arc<Table>,
    pub metrics: Arc<Metrics>,
    pub selector: Arc<Selector>,
    /// Shutdown has begun: not ready for new clients, whatever the fleet.
    pub draining: Arc<std::sync::atomic::AtomicBool>,
    pub control: Arc<Control>,
    /// The gRPC front door is on: `/ready` counts ranks it can route to as well.
    pub grpc_front: bool,
    /// `server.ready_requires_routable`: `/ready` is 503 while no rank is routable.
    pub ready_requires_routable: bool,
    /// The fleet-wide renders in progress ([`render`]).
    pub renders: Arc<Renders>,
    /// Flow control's queue (`[flow]` on), for `/flows`.
    pub flows: Option<Arc<crate::proxy::Flows>>,
    /// `[[adapters]]` loads, for `/adapters`.
    pub loader: Arc<crate::adapter_loads::Loader>,
}

impl Admin {
    /// `f` of this router, rendered off the runtime's threads ([`render`]).
    async fn render(
        self: Arc<Self>,
        f: impl FnOnce(&Admin) -> Response<Full<Bytes>> + Send + 'static,
    ) -> Response<Full<Bytes>> {
        let renders = self.renders.clone();
        off_runtime(&renders, move || f(&self)).await
    }

    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Response<Full<Bytes>>, Infallible> {
        let path = req.uri().path().to_string();
        Ok(match (req.method().clone(), path.as_str()) {
            (Method::GET, "/health") => respond(StatusCode::OK, "text/plain", "ok\n"),
            (Method::GET, "/ready") => self.ready(),
            (Method::GET, "/workers") => {
                self.render(|a| json_response(StatusCode::OK, &a.workers())).await
            }
            (Method::GET, "/engines") => {
                self.render(|a| json_response(StatusCode::OK, &a.engines())).await
            }
            (Method::GET, "/loads") => {
                let model = req.uri().query().and_then(|q| query_param(q, "model"));
                self.render(move |a| json_response(StatusCode::OK, &a.loads(model.as_deref())))
                    .await
            }
            (Method::GET, "/metrics") => {
                self.render(|a| {
                    respond(
                        StatusCode::OK,
                        crate::metrics::CONTENT_TYPE,
                        a.metrics.render(),
                    )
                })
                .await
            }
            (Method::POST, "/engines") | (Method::DELETE, "/engines") | (Method::POST, "/reload") => {
                match self.control.authorize(req.headers()) {
                    Ok(()) => self.mutate(req).await,
                    Err(refusal) => refused(refusal),
                }
            }
            (Method::GET, "/routes") => json_response(StatusCode::OK, &routes::page(&self.table)),
            (Method::GET, "/adapters") => {
                self.render(|a| json_response(StatusCode::OK, &adapters::page(&a.table, &a.loader)))
                    .await
            }
            (Method::POST, "/adapters/load" | "/adapters/unload") => {
                if let Err(refusal) = self.control.authorize(req.headers()) {
                    return Ok(refused(refusal));
                }
                let load = path == "/adapters/load";
                match read_body(req.into_body()).await {
                    Ok(body) => adapters::by_hand(self.loader.clone(), load, &body).await,
                    Err(r) => r,
                }
            }
            (Method::GET, "/flows") => json_response(
                StatusCode::OK,
                &(self.flows.as_deref()).map_or(serde_json::json!({"enabled": false}), crate::proxy::flow_page),
            ),
            (m, "/health" | "/ready" | "/workers" | "/loads" | "/metrics" | "/flows" | "/routes" | "/adapters") => {
                not_allowed(&path, &m, "GET")
            }
            (m, "/engines") => not_allowed(&path, &m, "GET, POST, DELETE"),
            (m, "/reload" | "/adapters/load" | "/adapters/unload") => {
                not_allowed(&path, &m, "POST")
            }
            (_, other) => openai_error(
                StatusCode::NOT_FOUND,
                "NotFoundError",
                &format!(
                    "unknown admin path {other}: try /health, /ready, /workers, /engines, /loads, /flows, /routes, /adapters, /metrics or /reload"
                ),
            ),
        })
    }

    /// `POST /engines`, `DELETE /engines?url=...`, `POST /reload`, once authorized.
    async fn mutate(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        let bad =
            |message: String| openai_error(StatusCode::BAD_REQUEST, "BadRequestError", &message);
        match (req.method().clone(), req.uri().path()) {
            (Method::POST, "/reload") => match self.control.reload().await {
                Ok(done) => {
                    tracing::info!(added = ?done.outcome.added, removed = ?done.outcome.removed, restart_needed = ?done.restart_needed, "config reloaded");
                    json_response(StatusCode::OK, &json!(done))
                }
                Err(err) => {
                    tracing::warn!(error = %err, "reload refused: the fleet is unchanged");
                    match err {
                        ReloadError::Membership(m) => membership_error(&m),
                        ReloadError::NoFile | ReloadError::Busy => {
                            openai_error(StatusCode::CONFLICT, "ConflictError", &err.to_string())
                        }
                        ReloadError::Config(e) => bad(e.to_string()),
                        ReloadError::Deadline { .. } | ReloadError::Reader { .. } => openai_error(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "ServiceUnavailableError",
                            &err.to_string(),
                        ),
                    }
                }
            },
            (Method::DELETE, _) => {
                let url = req.uri().query().and_then(|q| query_param(q, "url"));
                let Some(url) = url.filter(|u| !u.is_empty()) else {
                    return bad(
                        "DELETE /engines needs ?url=<the engine's url, as GET /engines lists it>"
                            .into(),
                    );
                };
                self.change(Change::Remove { url }).await
            }
            _ => {
                let body = match read_body(req.into_body()).await {
                    Ok(b) => b,
                    Err(r) => return r,
                };
                let raw: RawEngine = match serde_json::from_slice(&body) {
                    Ok(r) => r,
                    Err(e) => return bad(format!("POST /engines: the body must be one engine as a JSON object, with the keys of [[engines]]: {e}")),
                };
                if let Some(var) = raw
                    .api_key_env()
                    .filter(|v| !self.control.key_env_allowed(v))
                {
                    return bad(format!("POST /engines.api_key_env: {var:?} is not a variable the config file names for an engine's key; the admin API may name only those (so that it cannot send the process's environment elsewhere)"));
                }
                match raw.validate("POST /engines") {
                    Ok(engine) => self.change(Change::Add(engine)).await,
                    Err(e) => bad(e.problem()),
                }
            }
        }
    }

    async fn change(&self, change: Change) -> Response<Full<Bytes>> {
        match self.control.membership.apply(change).await {
            Ok(outcome) => json_response(StatusCode::OK, &json!(outcome)),
            Err(e) => membership_error(&e),
        }
    }

    /// One object per engine, in fleet order.
    pub fn engines(&self) -> Value {
        let snap = self.table.snapshot.load();
        let rows: Vec<Value> = (snap.fleet.engines.iter())
            .map(|e| {
                json!({
                    "url": e.url.as_ref(),
                    "name": e.cfg.name.as_deref(),
                    "grpc_url": e.grpc.is_some().then(|| e.grpc_origin()),
                    "flavor": e.flavor.as_str(),
                    "role": e.role.as_str(),
                    "bootstrap_port": e.sglang_bootstrap_port(),
                    "dp_size": e.dp_size,
                    "start_rank": e.start_rank,
                    "dp_group": match &e.deployment {
                        Deployment::Own => None,
                        Deployment::Member { group } => Some(group.as_deref().unwrap_or("")),
                    },
                    "configured": {"flavor": e.declared.flavor.map(Flavor::as_str), "dp_size": e.declared.dp_size},
                    "reported": e.reported.as_ref().map(|r| json!({"flavor": r.flavor.as_str(), "dp_size": r.dp_size, "from": r.from})),
                    "mismatch": e.mismatch(),
                    "unshaped": e.unshaped.load().as_deref().map(String::as_str),
                    "origin": e.origin.to_string(),
                    "workers": e.members.iter().map(|m| m.id_text.as_ref()).collect::<Vec<_>>(),
                })
            })
            .collect();
        Value::Array(rows)
    }

    /// One object per virtual worker.
    pub fn workers(&self) -> Value {
        let table = &self.table;
        let snap = table.snapshot.load();
        let now = Instant::now();
        let kv_events = self.control.kv_events();
        let rows: Vec<Value> = (snap.fleet.workers.iter())
            .zip(&snap.ranks)
            .map(|(w, view)| {
                let live = &w.live;
                let engine = &snap.fleet.engines[w.engine];
                // An ejected rank takes no traffic whatever its telemetry says, so that is its
                // state.
                let reason = live
                    .outlier
                    .ejection()
                    .map(Reason::Ejected)
                    .or_else(|| view.telemetry.unavailable_reason(now, table.stale_after));
                let reach = reach::of(view, reason.as_ref());
                // A fresh rank's zeros are not a reading: shown as its state, not as numbers.
                let (load, fresh) = match &view.telemetry {
                    RankTelemetry::Available(l) => (l.fresh.is_none().then_some(l), l.fresh),
                    RankTelemetry::Unavailable { .. } => (None, None),
                };
                let state = match (&reason, fresh) {
                    (Some(_), _) => "unavailable",
                    (None, Some(_)) => "fresh",
                    (None, None) => "available",
                };
                let row = json!({
                    "id": w.id_text.as_ref(),
                    "engine": engine.url.as_ref(),
                    "name": w.named.as_ref().and_then(|v| v.to_str().ok()),
                    "dp_rank": w.id.rank,
                    "flavor": engine.flavor.as_str(),
                    "role": w.role.as_str(),
                    "telemetry": state,
                    "fresh": fresh.map(Fresh::as_str),
                    "reason": reason.as_ref().map(ToString::to_string),
                    "reason_kind": reason.as_ref().map(|r| r.kind()),
                    "source": view.source.map_or("none", SourceKind::as_str),
                    "reachable": reach.reachable,
                    "health": reach.health,
                    "kv_usage": load.map(|l| l.kv_usage),
                    "num_running_reqs": load.and_then(|l| l.running),
                    "num_waiting_reqs": load.and_then(|l| l.waiting),
                    "num_used_tokens": load.and_then(|l| l.used_tokens),
                    "max_total_num_tokens": load.and_then(|l| l.capacity_tokens),
                    "aggregate": load.is_some_and(|l| l.aggregate),
                    "upstream_loads": load.and_then(|l| l.upstream.as_deref()),
                    "age_ms": load.map(|l| now.saturating_duration_since(l.sampled_at).as_millis() as u64),
                    "in_flight": live.in_flight(),
                    "adapters": (w.adapters.running().iter())
                        .map(|(name, n)| serde_json::json!({"name": &**name, "in_flight": n}))
                        .collect::<Vec<_>>(),
                    "max_lora": w.adapters.max_lora_said(),
                    "consecutive_failures": live.outlier.failures(),
                    "failures": failures::shown(w),
                    "engine_note": engine.mismatch(),
                    "kv_index": crate::kv::status::shown(&w.kv, kv_events),
                    "pd": (crate::metrics::PdLeg::of(w.role))
                        .map(|leg| w.counters.pd_health.shown(leg, engine.flavor)),
                });
                rows::with_models(row, snap.catalog.of(w.engine), engine.models.is_some())
            })
            .chain(snap.fleet.engines.iter().filter(|e| !e.shaped()).map(rows::unshaped_row))
            .collect();
        Value::Array(rows)
    }
}

impl Admin {
    /// rankgate's own load report, from the cached snapshot: one entry per rank with fresh
    /// telemetry (ranks without are omitted, never shown idle), optionally only for engines
    /// serving `model`.
    pub fn loads(&self, model: Option<&str>) -> Value {
        let table = &self.table;
        let snap = table.snapshot.load();
        let now = Instant::now();
        let mut loads = Vec::new();
        let (mut running, mut waiting, mut usage) = (0u64, 0u64, 0.0);
        for (w, view) in snap.fleet.workers.iter().zip(&snap.ranks) {
            if model.is_some_and(|m| !snap.catalog.serves(w.engine, m)) {
                continue;
            }
            // A fresh rank (no gauges yet) has no report to pass on: left out, as the engine
            // itself leaves it out.
            let Some(l) =
                (view.telemetry.fresh(now, table.stale_after)).filter(|l| l.fresh.is_none())
            else {
                continue;
            };
            let engine = &snap.fleet.engines[w.engine];
            let (r, q) = (l.running.unwrap_or(0), l.waiting.unwrap_or(0));
            running += r as u64;
            waiting += q as u64;
            usage += l.kv_usage;
            loads.push(json!({
                "worker": engine.url.as_ref(),
                "worker_type": if w.id.rank.is_some() { "regular" } else { "gateway" },
                "dp_rank": w.id.rank.unwrap_or(0),
                "num_running_reqs": r,
                "num_waiting_reqs": q,
                "num_total_reqs": r + q,
                "num_used_tokens": l.used_tokens,
                "max_total_num_tokens": l.capacity_tokens,
                "token_usage": l.kv_usage,
            }));
        }
        let n = loads.len();
        json!({
            "timestamp": iso8601(std::time::SystemTime::now()),
            "version": concat!("rankgate ", env!("CARGO_PKG_VERSION")),
            "dp_rank_count": n,
            "loads": loads,
            "aggregate": {
                "total_running_reqs": running,
                "total_waiting_reqs": waiting,
                "total_reqs": running + waiting,
                "avg_token_usage": if n > 0 { usage / n as f64 } else { 0.0 },
                "avg_throughput": 0.0,
                "avg_utilization": 0.0,
            },
        })
    }
}

/// The answer to a mutation refused before it was looked at.
fn refused(refusal: Refusal) -> Response<Full<Bytes>> {
    match refusal {
        Refusal::Disabled => openai_error(
            StatusCode::FORBIDDEN,
            "PermissionDeniedError",
            "admin changes are off: set server.admin_token_env to the environment variable holding the admin token",
        ),
        Refusal::Denied(d) => {
            let message = match d {
                Denied::Missing => "missing admin token: send `Authorization: Bearer <token>` with the token in server.admin_token_env's variable",
                Denied::NotBearer => "the Authorization header must read `Bearer <admin token>`",
                Denied::Wrong => "invalid admin token",
            };
            let mut r = openai_error(StatusCode::UNAUTHORIZED, "AuthenticationError", message);
            r.headers_mut()
                .insert(http::header::WWW_AUTHENTICATE, http::HeaderValue::from_static("Bearer"));
            r
        }
    }
}

fn membership_error(e: &MembershipError) -> Response<Full<Bytes>> {
    let status = match e {
        MembershipError::Exists { .. }
        | MembershipError::RankOverlap { .. }
        | MembershipError::TooManyWorkers { .. } => StatusCode::CONFLICT,
        MembershipError::NotFound { .. } => StatusCode::NOT_FOUND,
        MembershipError::Stopped => StatusCode::SERVICE_UNAVAILABLE,
    };
    openai_error(status, "MembershipError", &e.to_string())
}

/// Largest admin request body: one engine's keys.
const MAX_ADMIN_BODY: usize = 64 * 1024;

/// The whole body of an admin request, within a size (413) and a time (408) limit.
async fn read_body(body: Incoming) -> Result<Bytes, Response<Full<Bytes>>> {
    let limited = http_body_util::Limited::new(body, MAX_ADMIN_BODY);
    match tokio::time::timeout(std::time::Duration::from_secs(10), limited.collect()).await {
        Ok(Ok(b)) => Ok(b.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(openai_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "BadRequestError",
            &format!("the body is over {MAX_ADMIN_BODY} bytes: one engine's keys fit in far less"),
        )),
        Ok(Err(e)) => Err(openai_error(
            StatusCode::BAD_REQUEST,
            "BadRequestError",
            &format!("reading the body: {e}"),
        )),
        Err(_) => Err(openai_error(
            StatusCode::REQUEST_TIMEOUT,
            "TimeoutError",
            "the body did not arrive within 10 s",
        )),
    }
}

/// 405 with the methods the path takes.
fn not_allowed(path: &str, method: &Method, allow: &'static str) -> Response<Full<Bytes>> {
    let mut r = openai_error(
        StatusCode::METHOD_NOT_ALLOWED,
        "MethodNotAllowedError",
        &format!("{path} takes {allow}, not {method}"),
    );
    r.headers_mut()
        .insert(http::header::ALLOW, http::HeaderValue::from_static(allow));
    r
}

/// UTC time as ISO 8601 (`2026-12-02T14:00:00.123Z`).
fn iso8601(t: std::time::SystemTime) -> String {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (year, month, day) = crate::x509::civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn iso8601_dates() {
        assert_eq!(iso8601(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        // 2024-02-29 12:34:56.789 UTC, a leap day.
        let t = UNIX_EPOCH + Duration::from_millis(1_709_210_096_789);
        assert_eq!(iso8601(t), "2024-02-29T12:34:56.789Z");
    }
}
