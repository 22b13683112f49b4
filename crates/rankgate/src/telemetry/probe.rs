//! `rankgate check --probe`: each engine read once, the way the router reads it, for an operator
//! checking a config before serving it: reachable or not, flavor and DP size (as configured or
//! as the engine says) and the ranks (virtual workers) they give, models, which telemetry source
//! answered and how many ranks it gave numbers for, whether it offers KV-cache events
//! (`GET /kv_event_sources`), and every request that failed, named with what came back. What
//! could not be learned says `unknown`, never a value (a DP size of 0, an error as a model).

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
    /// Something answered: its health path (any HTTP answer), the shape question, a telemetry
    /// source or the model list. As in `/workers`: an engine whose health path answers 503 is
    /// reachable (and unhealthy).
    pub reachable: bool,
    /// `ok`, `unhealthy (<what the health path answered>)`, or `unknown (<why>)`, as
    /// `/workers`' `health` says it.
    pub health: String,
    /// The flavor as configured or read, else `unknown (<why>)`.
    pub flavor: String,
    /// `None` while the engine has not said it (and the config leaves it to the engine).
    pub dp_size: Option<u32>,
    /// The virtual workers (`url@rank`) its shape gives; empty while it is not known.
    pub ranks: Vec<String>,
    /// The model list; `None` when it could not be read (why is in `problems`).
    pub models: Option<Vec<String>>,
    /// The source that answered, the ranks it gave numbers for (or shows fresh), and of those
    /// the fresh ones (named, no load gauges yet); `None` when none answered.
    pub telemetry: Option<(&'static str, usize, usize)>,
    /// Whether it lists KV-event sources; `None` when `/kv_event_sources` got no answer.
    pub kv_events: Option<bool>,
    /// Its role, with an SGLang prefill server's bootstrap port (`Engine::role_text`).
    pub role: String,
    /// Each request that failed, naming it: what was asked and what came back (or did not).
    pub problems: Vec<String>,
}

/// Reads each engine once, all at the same time, each request bounded by `cfg.timeout`;
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

/// Most requests the shape question makes one after the other (SGLang's server info, vLLM's
/// version, metrics, KV-event sources): its whole bound, each request having its own.
const SHAPE_REQUESTS: u32 = 4;

/// Unavailable ranks whose reasons one probe line lists at most.
const MAX_RANK_PROBLEMS: usize = 8;

async fn one(
    engine: Engine,
    cfg: TelemetryConfig,
    http: HttpClient,
    transport: grpc::Transport,
) -> Probed {
    // Each GET bounded on its own, so that a failure names the request that got no answer.
    let http = http
        .with_key(engine.api_key.clone())
        .with_limit(cfg.timeout);
    let mut problems = Vec::new();
    let url = &engine.url;
    let get = |path: &str| -> Result<http::Uri, String> {
        format!("{url}{path}")
            .parse()
            .map_err(|e| format!("GET {path}: {e}"))
    };
    // The health path: any HTTP answer (an error status too) says the engine is up.
    let mut health_answered = false;
    let mut health = "unknown (no health path: gRPC only, or none configured)".to_string();
    if let (true, Some(path)) = (engine.http, engine.health_path.as_deref()) {
        match get(path) {
            Ok(uri) => match fetch(&http, uri).await {
                Ok(_) => {
                    health_answered = true;
                    health = "ok".into();
                }
                Err(f) => {
                    health_answered = f.answered;
                    health = match f.answered {
                        true => format!("unhealthy ({path} answered {})", f.reason),
                        false => format!("unknown ({path} did not answer)"),
                    };
                    problems.push(format!("GET {path}: {}", f.reason));
                }
            },
            Err(e) => problems.push(e),
        }
    }
    let whole = cfg.timeout * SHAPE_REQUESTS;
    let asked = tokio::time::timeout(whole, detect::detect(&engine, &http, &transport))
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "asked its flavor and DP size: no answer within {} ms",
                whole.as_millis()
            ))
        });
    let shaped = match &asked {
        Ok(r) => engine.with_reported(Some(r)),
        Err(why) => {
            problems.push(why.clone());
            engine.clone()
        }
    };
    let models = match (engine.http, &engine.models) {
        (_, Some(fixed)) => Some(fixed.clone()),
        (false, None) => {
            problems.push("gRPC only: no model list".into());
            None
        }
        (true, None) => match get("/v1/models") {
            Ok(uri) => match models::read(&http, uri).await {
                Ok(l) => Some(l.into_iter().map(|m| m.id).collect()),
                Err(e) => {
                    problems.push(format!("GET /v1/models: {e}"));
                    None
                }
            },
            Err(e) => {
                problems.push(e);
                None
            }
        },
    };
    let entry = (shaped.shaped())
        .then(|| EngineEntry::new(shaped.clone(), Origin::Config, ConnLimits::default(), None));
    let ranks: Vec<String> = (entry.iter())
        .flat_map(|e| e.members.iter().map(|m| m.id_text.to_string()))
        .collect();
    let telemetry = match entry {
        None => {
            problems.push("telemetry not read: the flavor or DP size is not known".into());
            None
        }
        Some(entry) => match poller::Poller::new(entry, cfg.clone(), http.clone(), transport) {
            Ok(mut p) => {
                let (source, polled) = p.poll_once().await;
                let routable = (polled.iter())
                    .filter(|r| matches!(r, RankTelemetry::Available(_)))
                    .count();
                let fresh = (polled.iter())
                    .filter(|r| matches!(r, RankTelemetry::Available(l) if l.fresh.is_some()))
                    .count();
                match (source, polled.first()) {
                    (None, Some(RankTelemetry::Unavailable { reason })) => {
                        problems.push(format!("telemetry: {reason}"));
                        None
                    }
                    _ => {
                        // Each rank that gets no traffic says why, as `/workers` does (a few).
                        let dark = (polled.iter()).filter_map(|r| match r {
                            RankTelemetry::Unavailable { reason } => Some(reason),
                            RankTelemetry::Available(_) => None,
                        });
                        for reason in dark.take(MAX_RANK_PROBLEMS) {
                            problems.push(format!("telemetry: {reason}"));
                        }
                        Some((source.map_or("none", SourceKind::as_str), routable, fresh))
                    }
                }
            }
            Err(e) => {
                problems.push(format!("telemetry: {e}"));
                None
            }
        },
    };
    let kv_events = match (engine.http, get("/kv_event_sources")) {
        (false, _) | (_, Err(_)) => Some(false),
        (true, Ok(uri)) => match fetch(&http, uri).await {
            Ok(body) => Some(
                serde_json::from_slice::<serde_json::Value>(&body)
                    .is_ok_and(|v| v.as_object().is_some_and(|o| !o.is_empty())),
            ),
            // An HTTP error (a 404: no such route) is an answer: it offers none.
            Err(f) if f.answered => Some(false),
            Err(f) => {
                problems.push(format!("GET /kv_event_sources: {}", f.reason));
                None
            }
        },
    };
    Probed {
        url: engine.url.to_string(),
        reachable: health_answered || asked.is_ok() || models.is_some() || telemetry.is_some(),
        flavor: match (shaped.shaped() || shaped.declared.flavor.is_some(), &asked) {
            (true, _) => shaped.flavor.as_str().into(),
            (false, Err(_)) => {
                "unknown (not configured, and the engine did not say: see problems)".into()
            }
            (false, Ok(_)) => "unknown (not configured, and not in what the engine said)".into(),
        },
        health,
        dp_size: shaped.shaped().then_some(shaped.dp_size),
        ranks,
        models,
        telemetry,
        kv_events,
        role: shaped.role_text(),
        problems,
    }
}

impl Probed {
    /// Why this engine's ranks would get no traffic if served as probed, or `None` when they
    /// would: nothing answered, its health path failed, or its ranks are not known.
    pub fn no_traffic(&self) -> Option<String> {
        if !self.reachable {
            return Some("nothing answered".into());
        }
        if self.health.starts_with("unhealthy") {
            return Some(format!("reachable but {}", self.health));
        }
        if self.ranks.is_empty() {
            return Some("its flavor or DP size is not known, so it has no ranks".into());
        }
        None
    }

    /// One line of the table `check --probe` prints: each column says what was found, or
    /// `unknown`; what failed, and on which request, is in `problems`.
    pub fn line(&self) -> String {
        let unknown = || "unknown".to_string();
        let dp_size = self.dp_size.map_or_else(unknown, |n| n.to_string());
        let ranks = match self.ranks.is_empty() {
            true => unknown(),
            false => self.ranks.join(","),
        };
        let models = self.models.as_ref().map_or_else(unknown, |m| m.join(","));
        let telemetry = match (&self.telemetry, self.dp_size) {
            (Some((source, ok, fresh)), n) => {
                let of = n.map(|n| format!("/{n}")).unwrap_or_default();
                match fresh {
                    0 => format!("{source}: {ok}{of} ranks"),
                    f => format!("{source}: {ok}{of} ranks ({f} fresh: no load gauges yet)"),
                }
            }
            (None, _) => unknown(),
        };
        let kv_events = match self.kv_events {
            Some(true) => "yes",
            Some(false) => "no",
            None => "unknown",
        };
        let problems = match self.problems.is_empty() {
            true => String::new(),
            false => format!("\tproblems={}", self.problems.join("; ")),
        };
        format!(
            "{}\treachable={}\thealth={}\tflavor={}\tdp_size={dp_size}\tranks={ranks}\trole={}\tmodels={models}\ttelemetry={telemetry}\tkv_events={kv_events}{problems}",
            self.url,
            if self.reachable { "yes" } else { "no" },
            self.health,
            self.flavor,
            self.role,
        )
    }
}
