//! The admin listener: `/health`, `/ready`, `/workers` and `/metrics`, all answered from the
//! cached snapshot and counters; no admin call ever reaches an engine.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::http::{json_response, openai_error, respond};
use crate::metrics::Metrics;
use crate::policy::Selector;
use crate::table::{RankTelemetry, Table};
use crate::telemetry::TelemetryStats;

/// What the admin handlers read.
pub struct Admin {
    pub table: Arc<Table>,
    pub metrics: Arc<Metrics>,
    pub telemetry: Arc<TelemetryStats>,
    pub selector: Arc<Selector>,
}

impl Admin {
    pub async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Response<Full<Bytes>>, Infallible> {
        if req.method() != Method::GET {
            return Ok(openai_error(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowedError",
                &format!("admin endpoints take GET, not {}", req.method()),
            ));
        }
        Ok(match req.uri().path() {
            "/health" => respond(StatusCode::OK, "text/plain", "ok\n"),
            "/ready" => {
                if self.selector.any_routable(&self.table) {
                    respond(StatusCode::OK, "text/plain", "ready\n")
                } else {
                    respond(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "text/plain",
                        "no routable rank yet\n",
                    )
                }
            }
            "/workers" => json_response(StatusCode::OK, &self.workers()),
            "/metrics" => respond(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                self.metrics.render(&self.table, &self.telemetry),
            ),
            other => openai_error(
                StatusCode::NOT_FOUND,
                "NotFoundError",
                &format!("unknown admin path {other}: try /health, /ready, /workers or /metrics"),
            ),
        })
    }

    /// One object per virtual worker.
    pub fn workers(&self) -> Value {
        let table = &self.table;
        let snap = table.snapshot.load();
        let now = Instant::now();
        let rows: Vec<Value> = table
            .fleet
            .workers
            .iter()
            .zip(&snap.ranks)
            .zip(&table.live)
            .map(|((w, view), live)| {
                let engine = &table.fleet.engines[w.engine];
                let reason = view.telemetry.unavailable_reason(now, table.stale_after);
                let (kv, running, waiting, age, capacity, aggregate) = match &view.telemetry {
                    RankTelemetry::Available(l) => (
                        Some(l.kv_usage),
                        l.running,
                        l.waiting,
                        Some(now.saturating_duration_since(l.sampled_at).as_millis() as u64),
                        l.capacity_tokens,
                        l.aggregate,
                    ),
                    RankTelemetry::Unavailable { .. } => (None, None, None, None, None, false),
                };
                json!({
                    "id": w.id_text.as_ref(),
                    "engine": engine.url.as_ref(),
                    "dp_rank": w.id.rank,
                    "flavor": engine.flavor.as_str(),
                    "telemetry": if reason.is_none() { "available" } else { "unavailable" },
                    "reason": reason,
                    "source": view.source,
                    "reachable": view.reachable,
                    "kv_usage": kv,
                    "num_running_reqs": running,
                    "num_waiting_reqs": waiting,
                    "max_total_num_tokens": capacity,
                    "aggregate": aggregate,
                    "age_ms": age,
                    "in_flight": live.in_flight(),
                })
            })
            .collect();
        Value::Array(rows)
    }
}
