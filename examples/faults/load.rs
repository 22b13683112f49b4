//! The bounded streaming load of one row and what it observes: each request's outcome (how its
//! stream ended), `/workers` sampled through the run, and sums of the admin `/metrics`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Load: one streaming request every `1/RATE` s from the start of the load to its end.
const RATE: f64 = 40.0;

/// One request may take at most this long, whatever happens: a hang in rankgate shows up as a
/// client timeout in the table instead of a runner that never ends.
pub const REQUEST_CAP: Duration = Duration::from_secs(10);
/// How often `/workers` is sampled for the timing columns.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(20);
/// Tokens each streamed answer carries, and the simulated decode speed: a stream lasts ~0.35 s,
/// long enough that a killed engine has streams open.
const OUTPUT_TOKENS: u64 = 32;
pub const DECODE_TOKENS_PER_SEC: f64 = 100.0;

/// How one request ended, from the client's side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// 2xx and the stream ended with `data: [DONE]`.
    Ok,
    /// No response at all: connecting or the connection failed before the headers.
    Transport,
    /// A non-2xx answer.
    Status(u16),
    /// 2xx, then the stream ended with rankgate's `data: {"error": ...}` event.
    CutErrorEvent,
    /// 2xx, then the stream broke or ended without `[DONE]` and without an error event.
    CutNoDone,
    /// Still running at [`REQUEST_CAP`].
    ClientTimeout,
}

#[derive(Debug, Clone)]
pub struct Outcome {
    /// When the response headers arrived, from the start of the load.
    pub headers_at: Option<Duration>,
    pub worker: Option<String>,
    pub end: End,
}

/// One `/workers` sample: per worker, (engine url, available, reason kind, in flight).
pub struct Sample {
    pub at: Duration,
    pub rows: Vec<SampleRow>,
}

pub type HttpClient = rankgate::http::HttpClient<Full<Bytes>>;

/// GETs `path` and returns the body, or why not; bounded by a 2 s timeout.
pub async fn get(client: &HttpClient, addr: SocketAddr, path: &str) -> Result<Bytes, String> {
    let req = Request::get(format!("http://{addr}{path}"))
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let fut = async {
        let resp = client.request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        if !status.is_success() {
            return Err(format!("{path}: {status}"));
        }
        Ok(body)
    };
    tokio::time::timeout(Duration::from_secs(2), fut)
        .await
        .map_err(|_| format!("{path}: no answer within 2 s"))?
}

pub async fn workers(client: &HttpClient, admin: SocketAddr) -> Result<Vec<Value>, String> {
    let body = get(client, admin, "/workers").await?;
    match serde_json::from_slice(&body) {
        Ok(Value::Array(rows)) => Ok(rows),
        Ok(other) => Err(format!("/workers is not an array: {other}")),
        Err(e) => Err(format!("/workers is not JSON: {e}")),
    }
}

/// The value of an unlabelled counter, or the sum of a labelled one's series, in `/metrics`.
pub fn metric_sum(text: &str, name: &str) -> u64 {
    metric_sum_with(text, name, "")
}

/// [`metric_sum`] over the series of `name` whose labels include `label` (`status="503"`).
pub fn metric_sum_with(text: &str, name: &str, label: &str) -> u64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
                && l.contains(label)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// One streaming chat request through rankgate, classified by how it ended.
pub async fn one(client: HttpClient, uri: http::Uri, body: Bytes, start: Instant) -> Outcome {
    let req = Request::builder()
        .method(Method::POST)
        .uri(uri)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(body));
    let resp = match req {
        Ok(r) => client.request(r).await,
        Err(_) => {
            return Outcome {
                headers_at: None,
                worker: None,
                end: End::Transport,
            }
        }
    };
    let Ok(resp) = resp else {
        return Outcome {
            headers_at: None,
            worker: None,
            end: End::Transport,
        };
    };
    let headers_at = Some(start.elapsed());
    let worker = resp
        .headers()
        .get("x-rankgate-worker")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let status = resp.status();
    let mut body = resp.into_body();
    // The whole stream is small (a few KB), so keeping it makes the checks below simple.
    let mut text = Vec::new();
    let mut broke = false;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                if let Some(d) = f.data_ref() {
                    text.extend_from_slice(d);
                }
            }
            Err(_) => {
                broke = true;
                break;
            }
        }
    }
    let end = if !status.is_success() {
        End::Status(status.as_u16())
    } else if contains(&text, b"data: {\"error\"") {
        End::CutErrorEvent
    } else if broke || !contains(&text, b"data: [DONE]") {
        End::CutNoDone
    } else {
        End::Ok
    };
    Outcome {
        headers_at,
        worker,
        end,
    }
}

pub fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Sends one streaming request every `1/RATE` s until `load_for` has passed; returns every
/// outcome once the last request ended (each is capped at [`REQUEST_CAP`]).
pub async fn drive(addr: SocketAddr, start: Instant, load_for: Duration) -> Vec<Outcome> {
    let client: HttpClient = rankgate::http::client(Duration::from_secs(2));
    let uri: http::Uri = match format!("http://{addr}/v1/chat/completions").parse() {
        Ok(u) => u,
        Err(_) => return Vec::new(),
    };
    let body = Bytes::from(
        json!({
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "tok ".repeat(50)}],
            "max_tokens": OUTPUT_TOKENS,
            "stream": true,
        })
        .to_string(),
    );
    let total = (RATE * load_for.as_secs_f64()) as usize;
    let gap = Duration::from_secs_f64(1.0 / RATE);
    let mut tasks = JoinSet::new();
    for i in 0..total {
        // A fixed schedule: request i goes at i/RATE, however long earlier ones take.
        tokio::time::sleep_until(start + gap * i as u32).await;
        let (c, u, b) = (client.clone(), uri.clone(), body.clone());
        tasks.spawn(async move {
            tokio::time::timeout(REQUEST_CAP, one(c, u, b, start))
                .await
                .unwrap_or(Outcome {
                    headers_at: None,
                    worker: None,
                    end: End::ClientTimeout,
                })
        });
    }
    let mut out = Vec::with_capacity(total);
    while let Some(r) = tasks.join_next().await {
        if let Ok(o) = r {
            out.push(o);
        }
    }
    out
}

/// Samples `/workers` every [`SAMPLE_EVERY`] until `stop` is set (and at most for `limit`).
pub async fn sample(
    admin: SocketAddr,
    start: Instant,
    stop: Arc<AtomicBool>,
    limit: Duration,
) -> Vec<Sample> {
    let client: HttpClient = rankgate::http::client(Duration::from_secs(1));
    let mut out = Vec::new();
    while !stop.load(Relaxed) && start.elapsed() < limit {
        if let Ok(rows) = workers(&client, admin).await {
            let rows = rows
                .iter()
                .map(|r| {
                    (
                        r["engine"].as_str().unwrap_or("").to_string(),
                        r["telemetry"] == "available",
                        r["reason_kind"].as_str().map(str::to_string),
                        r["in_flight"].as_u64().unwrap_or(0),
                    )
                })
                .collect();
            out.push(Sample {
                at: start.elapsed(),
                rows,
            });
        }
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    out
}

pub type SampleRow = (String, bool, Option<String>, u64);
