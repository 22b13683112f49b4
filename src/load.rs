//! A small load client: open-loop (Poisson arrivals) or closed-loop OpenAI requests against a
//! URL, recording per request its status, time to first byte of the body (TTFT for SSE), end-to-end
//! time and the `x-rankgate-worker` that served it. Every run is bounded by a request count and a
//! deadline.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write as _};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use rand::Rng;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// What to send, and how much of it.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Base URL of the target, e.g. `http://127.0.0.1:8080`.
    pub url: String,
    pub requests: usize,
    /// Open loop: mean arrivals per second (Poisson). `None`: closed loop with `concurrency` users.
    pub rate: Option<f64>,
    pub concurrency: usize,
    /// Hard cap on the run; requests not started by then are not sent.
    pub max_duration: Duration,
    pub prompt_chars: usize,
    pub max_tokens: u64,
    pub stream: bool,
    pub progress: bool,
}

/// One request's result.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub status: u16,
    /// Error before any status arrived (connect failure, reset...).
    pub error: Option<String>,
    pub ttft: Option<Duration>,
    pub e2e: Duration,
    pub worker: Option<String>,
}

/// All outcomes of a run.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub outcomes: Vec<Outcome>,
    pub elapsed: Duration,
    /// Arrival rate achieved, requests started per second.
    pub achieved_rate: f64,
}

/// Percentile (0..=100) of a sorted slice, nearest-rank.
pub fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

impl Report {
    pub fn ok(&self) -> impl Iterator<Item = &Outcome> {
        self.outcomes
            .iter()
            .filter(|o| o.error.is_none() && o.status == 200)
    }

    pub fn errors(&self) -> usize {
        self.outcomes.len() - self.ok().count()
    }

    /// Sorted TTFTs (or end-to-end times) of successful requests, optionally for one worker.
    pub fn sorted(&self, worker: Option<&str>, ttft: bool) -> Vec<Duration> {
        let mut v: Vec<Duration> = self
            .ok()
            .filter(|o| worker.is_none() || o.worker.as_deref() == worker)
            .filter_map(|o| if ttft { o.ttft } else { Some(o.e2e) })
            .collect();
        v.sort();
        v
    }

    /// Successful requests per worker.
    pub fn per_worker(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for o in self.ok() {
            *m.entry(o.worker.clone().unwrap_or_else(|| "-".into()))
                .or_default() += 1;
        }
        m
    }
}

fn body_for(spec: &LoadSpec) -> Bytes {
    let prompt: String =
        "lorem ipsum ".repeat(spec.prompt_chars / 12 + 1)[..spec.prompt_chars].to_string();
    Bytes::from(
        serde_json::json!({
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": spec.max_tokens,
            "stream": spec.stream,
        })
        .to_string(),
    )
}

async fn one(client: Client<HttpConnector, Full<Bytes>>, uri: http::Uri, body: Bytes) -> Outcome {
    let start = Instant::now();
    let req = Request::builder()
        .method(Method::POST)
        .uri(uri)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(body));
    let req = match req {
        Ok(r) => r,
        Err(e) => return failed(start, e.to_string()),
    };
    let resp = match client.request(req).await {
        Ok(r) => r,
        Err(e) => return failed(start, crate::telemetry::error_chain(&e)),
    };
    let status = resp.status().as_u16();
    let worker = resp
        .headers()
        .get("x-rankgate-worker")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut body = resp.into_body();
    let mut ttft = None;
    let mut error = None;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) if f.data_ref().is_some_and(|d| !d.is_empty()) && ttft.is_none() => {
                ttft = Some(start.elapsed());
            }
            Ok(_) => {}
            Err(e) => {
                error = Some(format!("body: {e}"));
                break;
            }
        }
    }
    Outcome {
        status,
        error,
        ttft,
        e2e: start.elapsed(),
        worker,
    }
}

fn failed(start: Instant, e: String) -> Outcome {
    Outcome {
        status: 0,
        error: Some(e),
        ttft: None,
        e2e: start.elapsed(),
        worker: None,
    }
}

/// Runs the load and returns every outcome.
pub async fn run(spec: &LoadSpec) -> Result<Report, String> {
    let uri: http::Uri = format!("{}/v1/chat/completions", spec.url.trim_end_matches('/'))
        .parse()
        .map_err(|e| format!("bad url {:?}: {e}", spec.url))?;
    let client: Client<HttpConnector, Full<Bytes>> = crate::http::client(Duration::from_secs(2));
    let body = body_for(spec);
    let started = Instant::now();
    let deadline = started + spec.max_duration;
    let done = Arc::new(AtomicUsize::new(0));
    let progress = (spec.progress && std::io::stderr().is_terminal())
        .then(|| spawn_progress(done.clone(), spec.requests));
    let mut tasks = JoinSet::new();
    let mut sent = 0usize;

    let launch = |tasks: &mut JoinSet<Outcome>| {
        let (c, u, b, d) = (client.clone(), uri.clone(), body.clone(), done.clone());
        tasks.spawn(async move {
            let t0 = Instant::now();
            let o = tokio::time::timeout_at(deadline, one(c, u, b))
                .await
                .unwrap_or_else(|_| failed(t0, "run deadline reached".into()));
            d.fetch_add(1, Relaxed);
            o
        });
    };

    let mut outcomes = Vec::with_capacity(spec.requests);
    match spec.rate {
        Some(rate) if rate > 0.0 => {
            let mut next = started;
            while sent < spec.requests {
                // Exponential inter-arrival gaps make the arrivals Poisson.
                let u: f64 = rand::rng().random_range(f64::EPSILON..1.0);
                next += Duration::from_secs_f64(-u.ln() / rate);
                if next >= deadline {
                    break;
                }
                tokio::time::sleep_until(next).await;
                launch(&mut tasks);
                sent += 1;
            }
        }
        _ => {
            while sent < spec.requests.min(spec.concurrency.max(1)) {
                launch(&mut tasks);
                sent += 1;
            }
            while let Some(r) = tasks.join_next().await {
                if let Ok(o) = r {
                    outcomes.push(o);
                }
                if sent < spec.requests && Instant::now() < deadline {
                    launch(&mut tasks);
                    sent += 1;
                }
            }
        }
    }
    let send_window = started.elapsed();
    while let Some(r) = tasks.join_next().await {
        if let Ok(o) = r {
            outcomes.push(o);
        }
    }
    if let Some(p) = progress {
        p.abort();
        eprintln!("\r{}", bar(outcomes.len(), spec.requests));
    }
    Ok(Report {
        outcomes,
        elapsed: started.elapsed(),
        achieved_rate: sent as f64 / send_window.as_secs_f64().max(1e-9),
    })
}

fn bar(done: usize, total: usize) -> String {
    const WIDTH: usize = 40;
    let filled = (done * WIDTH)
        .checked_div(total)
        .unwrap_or(WIDTH)
        .min(WIDTH);
    format!(
        "  [{}{}] {done}/{total} requests",
        "#".repeat(filled),
        ".".repeat(WIDTH - filled)
    )
}

fn spawn_progress(done: Arc<AtomicUsize>, total: usize) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tick.tick().await;
            eprint!("\r{}", bar(done.load(Relaxed), total));
            let _ = std::io::stderr().flush();
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&v, 50.0), Some(Duration::from_millis(50)));
        assert_eq!(percentile(&v, 99.0), Some(Duration::from_millis(99)));
        assert_eq!(percentile(&v, 100.0), Some(Duration::from_millis(100)));
        assert_eq!(percentile(&[], 50.0), None);
    }
}
