//! The reliability runner behind `docs/reliability.md`: every fault rankgate is built to survive,
//! each against a fresh simulated fleet under the same bounded streaming load, summed up in one
//! markdown table.
//!
//!   cargo run --release --example faults [-- --only <name>] [-- --json]
//!
//! Each row: 3 simulated vLLM engines x 2 DP ranks and one rankgate in this process, on
//! 127.0.0.1 with ports picked by the OS; streaming chat requests at a fixed rate for a fixed
//! time (so bounded in count and time, each request also capped); the fault switched on at a
//! fixed point of the run and (where it can be) off again later, while `/workers` is sampled
//! to time when the affected ranks leave and rejoin selection. Nothing here panics on a failure
//! of the thing under test: a fleet that fails to start or a check that times out becomes a
//! note in its row.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http::{header, Method, Request};
use http_body_util::{BodyExt, Full};
use rankgate::app::Router;
use rankgate::config::Config;
use rankgate_sim::sim::{SimConfig, SimEngine};
use serde_json::{json, Value};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Engines in the fleet, and DP ranks per engine.
const ENGINES: usize = 3;
const DP: u32 = 2;
/// Load: one streaming request every `1/RATE` s from the start of the load to its end.
const RATE: f64 = 40.0;
/// The fault starts this long into the load (telemetry and traffic have settled by then)...
const FAULT_AT: Duration = Duration::from_millis(1500);
/// ...and is cleared this long after it started...
const FAULT_FOR: Duration = Duration::from_secs(3);
/// ...and the load goes on this long after that, to see the ranks come back.
const AFTER: Duration = Duration::from_secs(3);
/// One request may take at most this long, whatever happens: a hang in rankgate shows up as a
/// client timeout in the table instead of a runner that never ends.
const REQUEST_CAP: Duration = Duration::from_secs(10);
/// How often `/workers` is sampled for the timing columns.
const SAMPLE_EVERY: Duration = Duration::from_millis(20);
/// Tokens each streamed answer carries, and the simulated decode speed: a stream lasts ~0.35 s,
/// long enough that a killed engine has streams open.
const OUTPUT_TOKENS: u64 = 32;
const DECODE_TOKENS_PER_SEC: f64 = 100.0;
/// A stalling engine stops after this many tokens.
const STALL_AFTER_TOKENS: u64 = 8;

/// rankgate under test: fast telemetry and short timeouts so each fault plays out in seconds.
/// The values are the ones the doc quotes; change both together.
const ROUTER_TOML: &str = r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
expose_worker = "url"
connect_timeout = "300ms"
response_timeout = "1s"
stream_idle_timeout = "1s"
drain_grace = "2s"

[routing]
max_attempts = 3
retry_budget = 0.2
eject_after = 5
eject_for = "1s"

[telemetry]
interval = "50ms"
stale_after = "500ms"
timeout = "200ms"
health_failures = 2
"#;

#[derive(Parser)]
#[command(about = "Runs every fault against a simulated fleet and prints one markdown table")]
struct Args {
    /// Run only this fault (see the `fault` column for names).
    #[arg(long)]
    only: Option<String>,
    /// Print the rows as JSON instead of the markdown table.
    #[arg(long)]
    json: bool,
}

/// The faults, in table order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Baseline,
    Kill,
    HangRequests,
    Stall,
    Fail503One,
    Health503,
    HangMetrics,
    HangModels,
    Fail503All,
}

const ALL: [Fault; 9] = [
    Fault::Baseline,
    Fault::Kill,
    Fault::HangRequests,
    Fault::Stall,
    Fault::Fail503One,
    Fault::Health503,
    Fault::HangMetrics,
    Fault::HangModels,
    Fault::Fail503All,
];

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Baseline => "baseline",
            Fault::Kill => "kill",
            Fault::HangRequests => "hang-requests",
            Fault::Stall => "stall",
            Fault::Fail503One => "503-one",
            Fault::Health503 => "health-503",
            Fault::HangMetrics => "hang-metrics",
            Fault::HangModels => "hang-models",
            Fault::Fail503All => "503-all",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Fault::Baseline => "no fault",
            Fault::Kill => "engine 0 killed under streaming load, restarted 3 s later",
            Fault::HangRequests => "engine 0 hangs every request for 3 s",
            Fault::Stall => "engine 0's streams stall after 8 tokens for 3 s",
            Fault::Fail503One => "engine 0 answers 503 to everything for 3 s",
            Fault::Health503 => "engine 0's /health answers 503 for 3 s, metrics healthy",
            Fault::HangMetrics => "engine 0's /metrics hangs for 3 s",
            Fault::HangModels => "engine 0's /v1/models hangs from its start until 4.5 s",
            Fault::Fail503All => "every engine answers 503 to everything for 3 s",
        }
    }

    /// Engines the fault hits; their ranks are the ones timed in the eject/recover columns.
    fn affected(self) -> Vec<usize> {
        match self {
            Fault::Baseline => Vec::new(),
            Fault::Fail503All => (0..ENGINES).collect(),
            _ => vec![0],
        }
    }
}

/// How one request ended, from the client's side.
#[derive(Debug, Clone, PartialEq, Eq)]
enum End {
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
struct Outcome {
    /// When the response headers arrived, from the start of the load.
    headers_at: Option<Duration>,
    worker: Option<String>,
    end: End,
}

/// One `/workers` sample: per worker, (engine url, available, reason kind, in flight).
struct Sample {
    at: Duration,
    rows: Vec<SampleRow>,
}

/// One row of the table.
#[derive(Debug, Default)]
struct Row {
    name: &'static str,
    title: &'static str,
    sent: usize,
    ok: usize,
    retried: u64,
    retries_refused: u64,
    ejections: u64,
    failed_before_first_byte: BTreeMap<String, usize>,
    cut_error_event: usize,
    cut_no_done: usize,
    client_timeouts: usize,
    /// Generation POSTs the engines received (every attempt that reached one).
    engine_posts: u64,
    to_eject: Option<Duration>,
    eject_kinds: Vec<String>,
    to_available: Option<Duration>,
    to_traffic: Option<Duration>,
    in_flight_end: Option<u64>,
    engine_open_end: Option<u64>,
    notes: Vec<String>,
    wall: Duration,
}

impl Row {
    fn failed_total(&self) -> usize {
        self.failed_before_first_byte.values().sum()
    }
}

type HttpClient = rankgate::http::HttpClient<Full<Bytes>>;

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn sim_config(i: usize) -> SimConfig {
    SimConfig {
        dp_size: DP,
        start_rank: i as u32 * DP,
        decode_tokens_per_sec: DECODE_TOKENS_PER_SEC,
        ..SimConfig::default()
    }
}

/// GETs `path` and returns the body, or why not; bounded by a 2 s timeout.
async fn get(client: &HttpClient, addr: SocketAddr, path: &str) -> Result<Bytes, String> {
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

async fn workers(client: &HttpClient, admin: SocketAddr) -> Result<Vec<Value>, String> {
    let body = get(client, admin, "/workers").await?;
    match serde_json::from_slice(&body) {
        Ok(Value::Array(rows)) => Ok(rows),
        Ok(other) => Err(format!("/workers is not an array: {other}")),
        Err(e) => Err(format!("/workers is not JSON: {e}")),
    }
}

/// The value of an unlabelled counter, or the sum of a labelled one's series, in `/metrics`.
fn metric_sum(text: &str, name: &str) -> u64 {
    metric_sum_with(text, name, "")
}

/// [`metric_sum`] over the series of `name` whose labels include `label` (`status="503"`).
fn metric_sum_with(text: &str, name: &str, label: &str) -> u64 {
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
async fn one(client: HttpClient, uri: http::Uri, body: Bytes, start: Instant) -> Outcome {
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

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Sends one streaming request every `1/RATE` s until `load_for` has passed; returns every
/// outcome once the last request ended (each is capped at [`REQUEST_CAP`]).
async fn drive(addr: SocketAddr, start: Instant, load_for: Duration) -> Vec<Outcome> {
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
async fn sample(
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

/// The fleet of one row.
struct Fleet {
    engines: Vec<SimEngine>,
    /// Engines killed and replaced, kept until the end so their counters can be read.
    dead: Vec<SimEngine>,
    router: Router,
}

async fn start_fleet(fault: Fault) -> Result<Fleet, String> {
    let mut engines = Vec::with_capacity(ENGINES);
    for i in 0..ENGINES {
        let mut cfg = sim_config(i);
        // The model list is read once at start and then about once a minute, so a hang that
        // starts mid-run would never be seen: this one is there from the engine's start.
        cfg.hang_models = fault == Fault::HangModels && i == 0;
        let e = SimEngine::start(loopback(), cfg)
            .await
            .map_err(|e| format!("engine {i}: {e}"))?;
        engines.push(e);
    }
    let mut text = ROUTER_TOML.to_string();
    for (i, e) in engines.iter().enumerate() {
        text.push_str(&format!(
            "\n[[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\ndp_size = {DP}\nstart_rank = {}\n",
            e.url(),
            i as u32 * DP
        ));
    }
    let cfg = Config::from_str(&text).map_err(|e| format!("config: {e}"))?;
    let router = Router::start(cfg)
        .await
        .map_err(|e| format!("router: {e}"))?;
    Ok(Fleet {
        engines,
        dead: Vec::new(),
        router,
    })
}

/// Waits (at most `limit`) until `/workers` shows every rank available.
async fn wait_all_available(admin: SocketAddr, limit: Duration) -> Result<(), String> {
    let client: HttpClient = rankgate::http::client(Duration::from_secs(1));
    let deadline = Instant::now() + limit;
    let mut last = String::new();
    while Instant::now() < deadline {
        match workers(&client, admin).await {
            Ok(rows) if rows.iter().all(|r| r["telemetry"] == "available") => return Ok(()),
            Ok(rows) => {
                last = rows
                    .iter()
                    .filter(|r| r["telemetry"] != "available")
                    .map(|r| format!("{}: {}", r["id"], r["reason"]))
                    .collect::<Vec<_>>()
                    .join("; ")
            }
            Err(e) => last = e,
        }
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    Err(format!("not all ranks available within {limit:?}: {last}"))
}

/// Switches the fault on. Returns notes on anything that went wrong.
async fn apply(fault: Fault, fleet: &mut Fleet) -> Vec<String> {
    let mut notes = Vec::new();
    let e0 = &fleet.engines[0];
    match fault {
        Fault::Baseline | Fault::HangModels => {}
        Fault::Kill => e0.kill().await,
        Fault::HangRequests => e0.set_hang_requests(true),
        Fault::Stall => e0.set_stall_after_tokens(Some(STALL_AFTER_TOKENS)),
        Fault::Fail503One => {
            if let Err(e) = e0.set_fail(503, 100.0) {
                notes.push(format!("set_fail: {e}"));
            }
        }
        Fault::Health503 => {
            if let Err(e) = e0.set_health_status(503) {
                notes.push(format!("set_health_status: {e}"));
            }
        }
        Fault::HangMetrics => e0.set_hang_metrics(true),
        Fault::Fail503All => {
            for e in &fleet.engines {
                if let Err(err) = e.set_fail(503, 100.0) {
                    notes.push(format!("set_fail: {err}"));
                }
            }
        }
    }
    notes
}

/// Switches the fault off (a killed engine is started again on its old port).
async fn clear(fault: Fault, fleet: &mut Fleet) -> Vec<String> {
    let mut notes = Vec::new();
    let e0 = &fleet.engines[0];
    match fault {
        Fault::Baseline => {}
        Fault::Kill => {
            // Same address, so rankgate's config still points at it: a process restarted by
            // its supervisor.
            let addr = e0.addr;
            match SimEngine::start(addr, sim_config(0)).await {
                Ok(e) => {
                    let old = std::mem::replace(&mut fleet.engines[0], e);
                    fleet.dead.push(old);
                }
                Err(e) => notes.push(format!("restart on {addr} failed: {e}")),
            }
        }
        Fault::HangRequests => e0.set_hang_requests(false),
        Fault::Stall => e0.set_stall_after_tokens(None),
        Fault::Fail503One => {
            if let Err(e) = e0.set_fail(503, 0.0) {
                notes.push(format!("set_fail: {e}"));
            }
        }
        Fault::Health503 => {
            if let Err(e) = e0.set_health_status(200) {
                notes.push(format!("set_health_status: {e}"));
            }
        }
        Fault::HangMetrics => e0.set_hang_metrics(false),
        Fault::HangModels => e0.set_hang_models(false),
        Fault::Fail503All => {
            for e in &fleet.engines {
                if let Err(err) = e.set_fail(503, 0.0) {
                    notes.push(format!("set_fail: {err}"));
                }
            }
        }
    }
    notes
}

/// Runs one fault against a fresh fleet.
async fn run(fault: Fault) -> Row {
    let began = Instant::now();
    let mut row = Row {
        name: fault.name(),
        title: fault.title(),
        ..Row::default()
    };
    let mut fleet = match start_fleet(fault).await {
        Ok(f) => f,
        Err(e) => {
            row.notes.push(format!("fleet did not start: {e}"));
            row.wall = began.elapsed();
            return row;
        }
    };
    let (addr, admin) = (fleet.router.addr, fleet.router.admin_addr);
    if let Err(e) = wait_all_available(admin, Duration::from_secs(5)).await {
        row.notes.push(e);
    }
    let affected_urls: Vec<String> = fault
        .affected()
        .into_iter()
        .map(|i| fleet.engines[i].url())
        .collect();

    let load_for = FAULT_AT + FAULT_FOR + AFTER;
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(sample(
        admin,
        start,
        stop.clone(),
        load_for + REQUEST_CAP + Duration::from_secs(5),
    ));
    let load = tokio::spawn(drive(addr, start, load_for));

    // The hang-models fault is there from the start; every other one starts at FAULT_AT.
    let fault_at = if fault == Fault::HangModels {
        Duration::ZERO
    } else {
        tokio::time::sleep_until(start + FAULT_AT).await;
        // Taken before the switch: a kill's effects (cut streams) land while `apply` runs.
        let at = start.elapsed();
        let notes = apply(fault, &mut fleet).await;
        row.notes.extend(notes);
        at
    };
    tokio::time::sleep_until(start + FAULT_AT + FAULT_FOR).await;
    let clear_at = start.elapsed();
    let notes = clear(fault, &mut fleet).await;
    row.notes.extend(notes);

    let outcomes = match load.await {
        Ok(o) => o,
        Err(e) => {
            row.notes.push(format!("load task failed: {e}"));
            Vec::new()
        }
    };
    // After the last request ended rankgate should hold nothing: wait (bounded) for in-flight 0,
    // so a leak shows as a number rather than as a race with the last stream's guards.
    let client: HttpClient = rankgate::http::client(Duration::from_secs(1));
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut last_rows = Vec::new();
    loop {
        if let Ok(rows) = workers(&client, admin).await {
            let n: u64 = rows.iter().filter_map(|r| r["in_flight"].as_u64()).sum();
            row.in_flight_end = Some(n);
            last_rows = rows;
            if n == 0 {
                break;
            }
        }
        if Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    stop.store(true, Relaxed);
    let samples = sampler.await.unwrap_or_default();
    // A failure count left on an affected rank after the load weighs on its score still.
    let left: Vec<String> = last_rows
        .iter()
        .filter(|r| {
            affected_urls.iter().any(|u| r["engine"] == u.as_str())
                && r["consecutive_failures"].as_u64().unwrap_or(0) > 0
        })
        .map(|r| match r["reason"].as_str() {
            // An ejection with 0 ms left is a trial that is due but was never run.
            Some(reason) => format!(
                "rank {}: {} ({reason})",
                r["dp_rank"], r["consecutive_failures"]
            ),
            None => format!("rank {}: {}", r["dp_rank"], r["consecutive_failures"]),
        })
        .collect();
    if !left.is_empty() {
        row.notes.push(format!(
            "consecutive failures left at the end: {}",
            left.join(", ")
        ));
    }

    match get(&client, admin, "/metrics").await {
        Ok(m) => {
            let m = String::from_utf8_lossy(&m);
            row.retried = metric_sum(&m, "rankgate_retries_total");
            row.retries_refused = metric_sum(&m, "rankgate_retries_refused_total");
            row.ejections = metric_sum(&m, "rankgate_ejections_total");
            // 503s rankgate wrote itself: no rank could be picked (all out), no engine reached.
            let own = metric_sum_with(&m, "rankgate_local_responses_total", "status=\"503\"");
            if own > 0 {
                row.notes.push(format!(
                    "{own} of the 503s from rankgate itself (no rank left)"
                ));
            }
        }
        Err(e) => row.notes.push(format!("/metrics: {e}")),
    }
    let all = || fleet.engines.iter().chain(&fleet.dead);
    row.engine_posts = all().map(SimEngine::requests_received).sum();
    row.engine_open_end = Some(all().map(SimEngine::open_requests).sum());

    tally(&mut row, &outcomes);
    timing(
        &mut row,
        fault,
        &samples,
        &outcomes,
        &affected_urls,
        fault_at,
        clear_at,
    );

    fleet.router.shutdown().await;
    for e in fleet.engines.into_iter().chain(fleet.dead) {
        e.shutdown().await;
    }
    row.wall = began.elapsed();
    row
}

fn tally(row: &mut Row, outcomes: &[Outcome]) {
    row.sent = outcomes.len();
    for o in outcomes {
        match &o.end {
            End::Ok => row.ok += 1,
            End::Transport => {
                *row.failed_before_first_byte
                    .entry("transport".into())
                    .or_default() += 1
            }
            End::Status(s) => {
                *row.failed_before_first_byte
                    .entry(s.to_string())
                    .or_default() += 1
            }
            End::CutErrorEvent => row.cut_error_event += 1,
            End::CutNoDone => row.cut_no_done += 1,
            End::ClientTimeout => row.client_timeouts += 1,
        }
    }
}

type SampleRow = (String, bool, Option<String>, u64);

/// The rows of a sample that belong to the affected engines.
fn affected_rows<'a>(s: &'a Sample, urls: &[String]) -> Vec<&'a SampleRow> {
    s.rows.iter().filter(|r| urls.contains(&r.0)).collect()
}

/// Fills the timing columns from the `/workers` samples and the responses.
fn timing(
    row: &mut Row,
    fault: Fault,
    samples: &[Sample],
    outcomes: &[Outcome],
    urls: &[String],
    fault_at: Duration,
    clear_at: Duration,
) {
    if urls.is_empty() {
        return;
    }
    let out = samples.iter().find(|s| {
        s.at >= fault_at && {
            let a = affected_rows(s, urls);
            !a.is_empty() && a.iter().all(|r| !r.1)
        }
    });
    if let Some(s) = out {
        row.to_eject = Some(s.at - fault_at);
        let mut kinds: Vec<String> = affected_rows(s, urls)
            .iter()
            .filter_map(|r| r.2.clone())
            .collect();
        kinds.sort();
        kinds.dedup();
        row.eject_kinds = kinds;
        // Coming back is only measured for ranks that were out.
        row.to_available = samples
            .iter()
            .find(|s| s.at >= clear_at && affected_rows(s, urls).iter().all(|r| r.1))
            .map(|s| s.at - clear_at);
    }
    // Taking traffic again is measured whether or not the ranks were ever out: a rank that
    // was only scored down (never ejected) may still stay shunned after its fault is gone.
    row.to_traffic = outcomes
        .iter()
        .filter(|o| o.end == End::Ok)
        .filter(|o| {
            o.worker
                .as_deref()
                .is_some_and(|w| urls.iter().any(|u| w.starts_with(&format!("{u}@"))))
        })
        .filter_map(|o| o.headers_at)
        .filter(|t| *t >= clear_at)
        .min()
        .map(|t| t - clear_at);
    // Which affected ranks answered successfully after the clear, and how often.
    let mut served_after: BTreeMap<String, usize> = BTreeMap::new();
    for o in outcomes {
        if o.end != End::Ok || o.headers_at.is_none_or(|t| t < clear_at) {
            continue;
        }
        let Some(w) = o.worker.as_deref() else {
            continue;
        };
        if let Some((url, rank)) = w.rsplit_once('@') {
            if urls.iter().any(|u| u == url) {
                *served_after.entry(format!("rank {rank}")).or_default() += 1;
            }
        }
    }
    let ranks = samples.first().map_or(0, |s| affected_rows(s, urls).len());
    let per_rank: Vec<String> = served_after
        .iter()
        .map(|(r, n)| format!("{r}: {n}"))
        .collect();
    row.notes.push(format!(
        "affected ranks serving after the clear: {} of {ranks}{}",
        served_after.len(),
        if per_rank.is_empty() {
            String::new()
        } else {
            format!(" ({})", per_rank.join(", "))
        }
    ));
    // Ranks partly out (one of the two) say something too: note the first such moment.
    if row.to_eject.is_none() {
        if let Some(s) = samples
            .iter()
            .find(|s| s.at >= fault_at && affected_rows(s, urls).iter().any(|r| !r.1))
        {
            let kinds: Vec<String> = affected_rows(s, urls)
                .iter()
                .filter_map(|r| r.2.clone())
                .collect();
            row.notes.push(format!(
                "some affected ranks unavailable from +{:.2} s ({})",
                (s.at - fault_at).as_secs_f64(),
                kinds.join(", ")
            ));
        }
    }
    if fault == Fault::HangRequests {
        // Hung requests must not stay counted in flight: each is let go at response_timeout,
        // so in-flight on the hung engine's ranks peaks and then falls back to 0 even while
        // the engine still hangs (once its ranks are ejected no new ones arrive).
        let during = samples
            .iter()
            .filter(|s| s.at >= fault_at && s.at < clear_at)
            .map(|s| {
                (
                    s.at,
                    affected_rows(s, urls).iter().map(|r| r.3).sum::<u64>(),
                )
            });
        let (peak_at, peak) = during
            .clone()
            .max_by_key(|(_, n)| *n)
            .unwrap_or((fault_at, 0));
        let zero = samples
            .iter()
            .find(|s| s.at > peak_at && affected_rows(s, urls).iter().all(|r| r.3 == 0));
        match zero {
            Some(s) => row.notes.push(format!(
                "in flight on engine 0: peak {peak}, back to 0 at +{:.2} s after the fault started",
                (s.at - fault_at).as_secs_f64()
            )),
            None => row.notes.push(format!(
                "in flight on engine 0: peak {peak}, never back to 0 while sampled"
            )),
        }
    }
}

fn secs(d: Option<Duration>) -> String {
    d.map_or_else(|| "n/a".into(), |d| format!("{:.2} s", d.as_secs_f64()))
}

fn markdown(rows: &[Row]) -> String {
    let mut o = String::new();
    o.push_str("| fault | sent | ok | retried (refused) | failed before first byte | streams cut | engine POSTs / request | to eject | to available | to traffic | notes |\n");
    o.push_str("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let failed = if r.failed_before_first_byte.is_empty() {
            "0".to_string()
        } else {
            let parts: Vec<String> = r
                .failed_before_first_byte
                .iter()
                .map(|(k, n)| format!("{k}×{n}"))
                .collect();
            format!("{} ({})", r.failed_total(), parts.join(", "))
        };
        let cut = r.cut_error_event + r.cut_no_done;
        let cut = if cut == 0 {
            "0".to_string()
        } else {
            format!(
                "{cut} ({} error event, {} no [DONE])",
                r.cut_error_event, r.cut_no_done
            )
        };
        let eject = match r.to_eject {
            Some(_) => format!("{} ({})", secs(r.to_eject), r.eject_kinds.join(", ")),
            None => "n/a".into(),
        };
        let mut notes = Vec::new();
        if r.ejections > 0 {
            notes.push(format!("{} ejections", r.ejections));
        }
        if r.client_timeouts > 0 {
            notes.push(format!("{} client timeouts", r.client_timeouts));
        }
        notes.extend(r.notes.iter().cloned());
        notes.push(format!(
            "in flight after the load: {}, engines still holding: {}",
            r.in_flight_end.map_or("?".into(), |n| n.to_string()),
            r.engine_open_end.map_or("?".into(), |n| n.to_string())
        ));
        let per_request = if r.sent == 0 {
            "n/a".into()
        } else {
            format!("{:.2}", r.engine_posts as f64 / r.sent as f64)
        };
        o.push_str(&format!(
            "| `{}`: {} | {} | {} | {} ({}) | {} | {} | {} | {} | {} | {} | {} |\n",
            r.name,
            r.title,
            r.sent,
            r.ok,
            r.retried,
            r.retries_refused,
            failed,
            cut,
            per_request,
            eject,
            secs(r.to_available),
            secs(r.to_traffic),
            notes.join("; ")
        ));
    }
    o
}

fn ms(d: Option<Duration>) -> Value {
    d.map_or(Value::Null, |d| json!(d.as_millis() as u64))
}

fn to_json(rows: &[Row]) -> Value {
    Value::Array(
        rows.iter()
            .map(|r| {
                json!({
                    "fault": r.name,
                    "title": r.title,
                    "sent": r.sent,
                    "ok": r.ok,
                    "retried": r.retried,
                    "retries_refused": r.retries_refused,
                    "ejections": r.ejections,
                    "failed_before_first_byte": r.failed_before_first_byte,
                    "cut_error_event": r.cut_error_event,
                    "cut_no_done": r.cut_no_done,
                    "client_timeouts": r.client_timeouts,
                    "engine_posts": r.engine_posts,
                    "to_eject_ms": ms(r.to_eject),
                    "eject_reason_kinds": r.eject_kinds,
                    "to_available_ms": ms(r.to_available),
                    "to_traffic_ms": ms(r.to_traffic),
                    "in_flight_end": r.in_flight_end,
                    "engine_open_end": r.engine_open_end,
                    "notes": r.notes,
                    "wall_ms": r.wall.as_millis() as u64,
                })
            })
            .collect(),
    )
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let faults: Vec<Fault> = match &args.only {
        Some(name) => match ALL.iter().find(|f| f.name() == name) {
            Some(f) => vec![*f],
            None => {
                let names: Vec<&str> = ALL.iter().map(|f| f.name()).collect();
                eprintln!("unknown fault {name:?}; one of: {}", names.join(", "));
                std::process::exit(2);
            }
        },
        None => ALL.to_vec(),
    };
    let began = Instant::now();
    let mut rows = Vec::with_capacity(faults.len());
    for (i, f) in faults.iter().enumerate() {
        eprint!("[{}/{}] {} ... ", i + 1, faults.len(), f.name());
        let row = run(*f).await;
        eprintln!("{:.1} s", row.wall.as_secs_f64());
        rows.push(row);
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&to_json(&rows)).unwrap_or_default()
        );
    } else {
        print!("{}", markdown(&rows));
    }
    eprintln!("total {:.1} s", began.elapsed().as_secs_f64());
}
