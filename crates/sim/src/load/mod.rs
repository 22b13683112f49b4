//! The load client: OpenAI chat or completion requests, streaming or not, against a URL.
//!
//! Open loop (Poisson arrivals at a rate, plus scheduled bursts, or a trace's own timestamps) or
//! closed loop (N users, each sending its next request when the last one ends). Per request it
//! records when it was sent, its status or error kind, time to first token (first SSE event with
//! a token), the gaps between tokens, end-to-end time, tokens received and the
//! `x-rankgate-worker` that served it. Every run is bounded by a request count AND a deadline.
//!
//! Prompts are unique text (`text`) unless the workload shares prefixes on purpose: a hot shared
//! prefix on a share of requests, a trace's prefix ids, or multi-turn sessions (`session`) whose
//! turns repeat their history. Requests can be spread over several targets in turn (replicas of
//! one router), and over several model names (`models`: LoRA adapters served as models). `scrape`
//! reads the engines' prefix-cache counters, `fleet` the router's ranks.

pub mod dist;
pub mod fleet;
pub mod grpc;
mod models;
mod plan;
mod progress;

use progress::{end_progress, spawn_progress};
mod outcome;
pub mod report;
pub mod scrape;
pub mod sdk;
pub mod session;
pub mod tenants;
pub mod text;

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request};
use http_body_util::{BodyExt, Full};
use serde::Deserialize as _;
use tokio::task::JoinSet;
use tokio::time::Instant;

pub use dist::{Dist, TraceEntry};
pub use models::{check_models, ModelSpread, MAX_MODELS};
use plan::{body, plan, Planned};

pub use outcome::{ErrorKind, Outcome, ADMIN_TOKEN_HEADER, DEBUG_HEADER, HIDDEN};
pub use report::Report;
pub use session::Sessions;
pub use tenants::{run_tenants, Tenant, FAIRNESS_HEADER, OBJECTIVE_HEADER};

/// Which OpenAI endpoint to call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    Chat,
    Completions,
}

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrivals {
    /// Open loop: Poisson arrivals at this mean rate per second.
    Poisson(f64),
    /// Closed loop: this many users, each waiting for its answer before the next request.
    Closed(usize),
}

/// Extra requests all sent at one instant (open loop only).
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Burst {
    #[serde(deserialize_with = "de_duration")]
    pub at: Duration,
    pub requests: usize,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
}

/// A share of requests whose prompt starts with one long prefix, the same for all of them (a
/// shared document or a long common instruction).
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotPrefix {
    /// Share of the generated requests carrying it, in (0, 1].
    pub share: f64,
    /// Its length; the request's own prompt follows it.
    pub tokens: u64,
}

impl HotPrefix {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.share > 0.0 && self.share <= 1.0) {
            return Err(format!(
                "hot_prefix: share must be in (0, 1], got {}",
                self.share
            ));
        }
        if self.tokens == 0 {
            return Err("hot_prefix: tokens must be at least 1".into());
        }
        Ok(())
    }
}

pub(crate) fn de_duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    rankgate::config::HumanDuration::deserialize(d).map(|h| h.0)
}

/// A workload against one target.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Base URL of the target, e.g. `http://127.0.0.1:8080`.
    pub url: String,
    pub api: Api,
    pub stream: bool,
    pub arrivals: Arrivals,
    /// At most this many requests (bursts included).
    pub requests: usize,
    /// Nothing is sent after this, and requests still running then are cut off.
    pub duration: Duration,
    pub prompt_tokens: Dist,
    pub output_tokens: Dist,
    /// Replaces the distributions (and, where entries carry `at_ms`, the arrivals).
    pub trace: Option<Vec<TraceEntry>>,
    pub bursts: Vec<Burst>,
    pub model: String,
    /// Several models (LoRA adapters): requests name these, spread as `model_spread` says,
    /// instead of `model` ([`Workload::model_of`]).
    pub models: Vec<String>,
    pub model_spread: ModelSpread,
    /// gRPC instead of HTTP: streaming `Generate` on this flavor's service at `url`.
    pub grpc: Option<rankgate::worker::Flavor>,
    /// Multi-turn chat sessions instead of independent requests (HTTP chat only).
    pub sessions: Option<Sessions>,
    /// A share of the generated requests starting with one shared prefix.
    pub hot_prefix: Option<HotPrefix>,
    /// More base URLs: requests go to `url` and these in turn (HTTP only), as N replicas of a
    /// router behind a plain load balancer would each get 1/N of the requests.
    pub spread: Vec<String>,
    pub progress: bool,
    pub seed: u64,
    /// rankgate's admin token: each request asks (`x-rankgate-debug`) which rank served it, so
    /// the report names it under any `server.expose_worker`.
    pub admin_token: Option<Arc<str>>,
    /// Sent with every request (HTTP only): a tenant's fairness id and objective, and any other.
    pub headers: Headers,
}

/// Headers a workload sends with every request, checked when the workload is built.
pub type Headers = Arc<[(http::HeaderName, http::HeaderValue)]>;

impl Workload {
    pub fn new(url: impl Into<String>) -> Workload {
        Workload {
            url: url.into(),
            api: Api::Chat,
            stream: true,
            arrivals: Arrivals::Poisson(10.0),
            requests: 100,
            duration: Duration::from_secs(60),
            prompt_tokens: Dist::Fixed(200),
            output_tokens: Dist::Fixed(64),
            trace: None,
            bursts: Vec::new(),
            model: "tiny-llama".into(),
            models: Vec::new(),
            model_spread: ModelSpread::Even,
            grpc: None,
            sessions: None,
            hot_prefix: None,
            spread: Vec::new(),
            progress: false,
            seed: 1,
            admin_token: None,
            headers: Arc::new([]),
        }
    }
}

pub(crate) type HttpClient = rankgate::http::HttpClient<Full<Bytes>>;

/// Where a run's requests go.
enum Target {
    /// Requests go to the URIs in turn.
    Http(HttpClient, Vec<http::Uri>),
    Grpc(grpc::GrpcClient),
}

type Pending = std::pin::Pin<Box<dyn std::future::Future<Output = Outcome> + Send>>;

pub(crate) async fn one(
    client: HttpClient,
    uri: http::Uri,
    body: Bytes,
    stream: bool,
    start: Instant,
    admin_token: Option<Arc<str>>,
    headers: Headers,
) -> Outcome {
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(uri)
        .header(header::CONTENT_TYPE, "application/json");
    for (name, value) in headers.iter() {
        req = req.header(name, value);
    }
    if let Some(t) = &admin_token {
        req = req
            .header(DEBUG_HEADER, "1")
            .header(ADMIN_TOKEN_HEADER, &**t);
    }
    let req = req.body(Full::new(body));
    let resp = match req {
        Ok(r) => client.request(r).await.ok(),
        Err(_) => None,
    };
    let Some(resp) = resp else {
        return Outcome::failed(ErrorKind::Connect, start.elapsed());
    };
    let mut o = Outcome {
        status: resp.status().as_u16(),
        error: None,
        ..Outcome::failed(ErrorKind::Body, Duration::ZERO)
    };
    o.worker = resp
        .headers()
        .get("x-rankgate-worker")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut body = resp.into_body();
    let mut sse = SseTokens::default();
    let mut whole = Vec::new();
    let mut last: Option<Instant> = None;
    let mut broken = false;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            broken = true;
            break;
        };
        let Some(data) = frame.data_ref() else {
            continue;
        };
        let now = Instant::now();
        if stream {
            for _ in 0..sse.feed(data) {
                match last {
                    None => o.ttft = Some(now - start),
                    Some(prev) => o.itl.push(now - prev),
                }
                last = Some(now);
                o.tokens += 1;
            }
        } else {
            whole.extend_from_slice(data);
        }
    }
    o.e2e = start.elapsed();
    if !stream {
        o.ttft = Some(o.e2e);
        o.tokens = serde_json::from_slice::<serde_json::Value>(&whole)
            .ok()
            .and_then(|v| v["usage"]["completion_tokens"].as_u64())
            .unwrap_or(0);
    }
    o.error = match o.status {
        // A 2xx stream is ok only when it ended as the engine ends it.
        200..=299 if stream => sse.ending(broken),
        200..=299 if broken => Some(ErrorKind::Body),
        200..=299 => None,
        400..=499 => Some(ErrorKind::Http4xx),
        _ => Some(ErrorKind::Http5xx),
    };
    o
}

/// Reads an SSE stream across frame boundaries (an event is complete at a blank line): counts
/// the events that carry a token and notes how the stream ended. `[DONE]`, the final usage-only
/// chunk (`"choices":[]`) and error events (`data: {"error": ...}`) carry no token.
#[derive(Debug, Default)]
pub struct SseTokens {
    pending: Vec<u8>,
    /// `data: [DONE]` came: the engine ended the stream.
    done: bool,
    /// An error event came (rankgate's, when it cut the stream, or an engine's own).
    error_event: bool,
}

impl SseTokens {
    /// Takes the next bytes of the stream; returns how many token events they completed.
    pub fn feed(&mut self, data: &[u8]) -> usize {
        self.pending.extend_from_slice(data);
        let mut tokens = 0;
        while let Some(end) = find(&self.pending, b"\n\n") {
            let event = &self.pending[..end];
            if event.starts_with(b"data: [DONE]") {
                self.done = true;
            } else if event.starts_with(b"data: {\"error\"")
                || (event.starts_with(b"data: {") && find(event, b"\"object\":\"error\"").is_some())
            {
                self.error_event = true;
            } else if event.starts_with(b"data: ") && find(event, b"\"choices\":[]").is_none() {
                tokens += 1;
            }
            self.pending.drain(..end + 2);
        }
        tokens
    }

    /// What the stream's ending makes of a 2xx answer: `None` (ok) only for a stream that
    /// reached `[DONE]` without an error event; `broken`: the body failed mid-way.
    pub fn ending(&self, broken: bool) -> Option<ErrorKind> {
        match (self.error_event, self.done && !broken) {
            (true, _) => Some(ErrorKind::StreamErrorEvent),
            (false, false) => Some(ErrorKind::StreamCut),
            (false, true) => None,
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Runs the workload and returns every outcome.
pub async fn run(w: &Workload) -> Result<Report, String> {
    let path = match w.api {
        Api::Chat => "/v1/chat/completions",
        Api::Completions => "/v1/completions",
    };
    let uris = std::iter::once(&w.url)
        .chain(&w.spread)
        .map(|url| {
            format!("{}{path}", url.trim_end_matches('/'))
                .parse::<http::Uri>()
                .map_err(|e| format!("bad url {url:?}: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if w.grpc.is_some() && !w.spread.is_empty() {
        return Err("spreading over several targets is HTTP only".into());
    }
    if w.grpc.is_some() && !w.headers.is_empty() {
        return Err("request headers (a tenant's) are HTTP only".into());
    }
    if let Some(s) = &w.sessions {
        s.validate()?;
        if w.grpc.is_some() || w.api != Api::Chat {
            return Err("sessions are chat conversations: HTTP and --api chat only".into());
        }
    }
    if let Some(h) = &w.hot_prefix {
        h.validate()?;
    }
    w.check_models()?;
    let client = rankgate::http::client(Duration::from_secs(2));
    let target = match w.grpc {
        Some(flavor) => Target::Grpc(grpc::GrpcClient::new(flavor, w.url.trim_end_matches('/'))?),
        None => Target::Http(client.clone(), uris.clone()),
    };
    let planned = match w.sessions {
        Some(_) => Vec::new(),
        None => plan(w),
    };
    let total = match &w.sessions {
        Some(s) => s.requests().min(w.requests),
        None => planned.len(),
    };
    let started = Instant::now();
    let deadline = started + w.duration;
    let done = Arc::new(AtomicUsize::new(0));
    let progress = w.progress.then(|| spawn_progress(done.clone(), total));
    if let Some(s) = &w.sessions {
        let mut outcomes = session::run(w, s, client, uris, done, started).await;
        if let Some(p) = progress {
            p.abort();
            end_progress(outcomes.len(), total);
        }
        outcomes.sort_by_key(|o| o.sent);
        let last_send = outcomes.last().map_or(Duration::ZERO, |o| o.sent);
        return Ok(Report {
            achieved_rate: outcomes.len() as f64 / last_send.as_secs_f64().max(1e-9),
            requested_rate: None,
            scheduled_rate: None,
            elapsed: started.elapsed(),
            outcomes,
            ..Report::default()
        });
    }
    let mut tasks: JoinSet<Outcome> = JoinSet::new();

    let mut sent_count = 0usize;
    let mut launch = |tasks: &mut JoinSet<Outcome>, p: &Planned| {
        sent_count += 1;
        let d = done.clone();
        // Each request is timed from when its task starts.
        let call: Pending = match &target {
            Target::Http(c, uris) => {
                let u = uris[(sent_count - 1) % uris.len()].clone();
                let (c, b, stream) = (c.clone(), body(w, p), w.stream);
                let (token, headers) = (w.admin_token.clone(), w.headers.clone());
                Box::pin(async move { one(c, u, b, stream, Instant::now(), token, headers).await })
            }
            Target::Grpc(c) => {
                let c = c.clone();
                let g = grpc::GenerateCall {
                    request_id: format!("load-{}-{sent_count}", w.seed),
                    prompt_tokens: p.prompt,
                    max_tokens: p.output.min(u32::MAX as u64) as u32,
                    rank: None,
                    admin_token: w.admin_token.clone(),
                };
                Box::pin(async move { grpc::one(c, g, Instant::now()).await })
            }
        };
        let (scheduled, asked) = (p.at, p.output);
        tasks.spawn(async move {
            let t0 = Instant::now();
            let sent = t0 - started;
            let mut o = tokio::time::timeout_at(deadline, call)
                .await
                .unwrap_or_else(|_| Outcome::failed(ErrorKind::Deadline, t0.elapsed()));
            o.sent = sent;
            o.asked = asked;
            o.lag = scheduled.map_or(Duration::ZERO, |at| sent.saturating_sub(at));
            d.fetch_add(1, Relaxed);
            o
        });
    };

    let mut outcomes = Vec::with_capacity(total);
    let mut last_send = Duration::ZERO;
    match w.arrivals {
        Arrivals::Closed(users) => {
            let mut queue = planned.iter();
            for p in queue.by_ref().take(users.max(1)) {
                launch(&mut tasks, p);
            }
            while let Some(r) = tasks.join_next().await {
                outcomes.extend(r.ok());
                if Instant::now() < deadline {
                    if let Some(p) = queue.next() {
                        launch(&mut tasks, p);
                        last_send = started.elapsed();
                    }
                }
            }
        }
        Arrivals::Poisson(_) => {
            for p in &planned {
                if let Some(at) = p.at {
                    tokio::time::sleep_until(started + at).await;
                }
                launch(&mut tasks, p);
                last_send = started.elapsed();
            }
        }
    }
    while let Some(r) = tasks.join_next().await {
        outcomes.extend(r.ok());
    }
    if let Some(p) = progress {
        p.abort();
        end_progress(outcomes.len(), total);
    }
    outcomes.sort_by_key(|o| o.sent);
    let requested_rate = match (w.arrivals, &w.trace) {
        (Arrivals::Poisson(r), None) => Some(r),
        _ => None,
    };
    let scheduled_rate = planned
        .last()
        .and_then(|p| p.at)
        .map(|last| total as f64 / last.as_secs_f64().max(1e-9));
    Ok(Report {
        achieved_rate: outcomes.len() as f64 / last_send.as_secs_f64().max(1e-9),
        requested_rate,
        scheduled_rate,
        elapsed: started.elapsed(),
        outcomes,
        ..Report::default()
    })
}

#[cfg(test)]
mod tests;
