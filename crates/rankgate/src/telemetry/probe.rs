//! `rankgate check --probe`: each engine read once, the way the router reads it, for an operator
//! checking a config before serving it: reachable or not, flavor and DP size (as configured or
//! as the engine says), models, which telemetry source answered and how many ranks it gave
//! numbers for, and whether it offers KV-cache events (`GET /kv_event_sources`).

use std::time::Duration;

use super::client::{fetch, HttpClient};
use super::poller;
use super::{detect, grpc, models};
use crate::config::{SourceKind, TelemetryConfig};
use crate::table::RankTelemetry;
use crate::upstream::ConnLimits;
use crate::worker::{Engine, EngineEntry, Origin};

/// What one read of one engine found.
#[derive(Debug, Clone, PartialEq)]
pub struct Probed {
    pub url: String,
    /// Something answered: the shape question, a telemetry source or the model list.
    pub reachable: bool,
    pub flavor: String,
    pub dp_size: u32,
    pub models: Result<Vec<String>, String>,
    /// The source that answered, and the ranks it gave numbers for.
    pub telemetry: Result<(&'static str, usize), String>,
    pub kv_events: bool,
    /// Its role, with an SGLang prefill server's bootstrap port (`Engine::role_text`).
    pub role: String,
    /// Why the flavor or size could not be read, when they were asked.
    pub shape_problem: Option<String>,
}

/// Reads each engine once, all at the same time, each step bounded by `cfg.timeout`;
/// `https://` engines as `upstream` says.
pub async fn probe(
    engines: Vec<Engine>,
    cfg: &TelemetryConfig,
    upstream: &crate::tls::Upstream,
) -> Vec<Probed> {
    let http = HttpClient::new(crate::http::client_with(cfg.timeout, upstream));
    let transport = grpc::transport_with(cfg.timeout, upstream);
    let tasks: Vec<_> = (engines.into_iter())
        .map(|e| tokio::spawn(one(e, cfg.clone(), http.clone(), transport.clone())))
        .collect();
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        if let Ok(p) = t.await {
            out.push(p);
        }
    }
    out
}

async fn one(
    engine: Engine,
    cfg: TelemetryConfig,
    http: HttpClient,
    transport: grpc::Transport,
) -> Probed {
    let http = http.with_key(engine.api_key.clone());
    let bounded = |d: Duration| move |_| format!("no answer within {} ms", d.as_millis());
    let asked = tokio::time::timeout(cfg.timeout, detect::detect(&engine, &http, &transport))
        .await
        .unwrap_or_else(|e| Err(bounded(cfg.timeout)(e)));
    let (shaped, shape_problem) = match &asked {
        Ok(r) => (engine.with_reported(Some(r)), None),
        Err(why) => (engine.clone(), Some(why.clone())),
    };
    let models = match (engine.http, &engine.models) {
        (_, Some(fixed)) => Ok(fixed.clone()),
        (false, None) => Err("gRPC only: no model list".into()),
        (true, None) => match format!("{}/v1/models", engine.url).parse() {
            Ok(uri) => tokio::time::timeout(cfg.timeout, models::read(&http, uri))
                .await
                .unwrap_or_else(|e| Err(bounded(cfg.timeout)(e)))
                .map(|l| l.into_iter().map(|m| m.id).collect()),
            Err(e) => Err(e.to_string()),
        },
    };
    let telemetry = match shaped.shaped() {
        false => Err("not read: the flavor or DP size is not known".into()),
        true => {
            let entry =
                EngineEntry::new(shaped.clone(), Origin::Config, ConnLimits::default(), None);
            match poller::Poller::new(entry, cfg.clone(), http.clone(), transport) {
                Ok(mut p) => {
                    let (source, ranks) = p.poll_once().await;
                    let fresh = ranks
                        .iter()
                        .filter(|r| matches!(r, RankTelemetry::Available(_)))
                        .count();
                    match (source, ranks.first()) {
                        (None, Some(RankTelemetry::Unavailable { reason })) => {
                            Err(reason.to_string())
                        }
                        _ => Ok((source.map_or("none", SourceKind::as_str), fresh)),
                    }
                }
                Err(e) => Err(e),
            }
        }
    };
    let kv_events = engine.http
        && match format!("{}/kv_event_sources", engine.url).parse() {
            Ok(uri) => matches!(
                tokio::time::timeout(cfg.timeout, fetch(&http, uri)).await,
                Ok(Ok(body)) if serde_json::from_slice::<serde_json::Value>(&body)
                    .is_ok_and(|v| v.as_object().is_some_and(|o| !o.is_empty()))
            ),
            Err(_) => false,
        };
    Probed {
        url: engine.url.to_string(),
        reachable: asked.is_ok() || models.is_ok() || telemetry.is_ok(),
        flavor: match shaped.shaped() || shaped.declared.flavor.is_some() {
            true => shaped.flavor.as_str().into(),
            false => "?".into(),
        },
        dp_size: shaped.dp_size,
        models,
        telemetry,
        kv_events,
        role: shaped.role_text(),
        shape_problem,
    }
}

impl Probed {
    /// One line of the table `check --probe` prints.
    pub fn line(&self) -> String {
        let models = match &self.models {
            Ok(m) => m.join(","),
            Err(e) => format!("({e})"),
        };
        let telemetry = match &self.telemetry {
            Ok((source, fresh)) => format!("{source}: {fresh}/{} ranks", self.dp_size),
            Err(e) => format!("({e})"),
        };
        let shape = match &self.shape_problem {
            Some(p) => format!("\tasked: {p}"),
            None => String::new(),
        };
        format!(
            "{}\treachable={}\tflavor={}\tdp_size={}\trole={}\tmodels={models}\ttelemetry={telemetry}\tkv_events={}{shape}",
            self.url,
            if self.reachable { "yes" } else { "no" },
            self.flavor,
            self.dp_size,
            self.role,
            if self.kv_events { "yes" } else { "no" },
        )
    }
}
