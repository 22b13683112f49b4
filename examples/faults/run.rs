//! One row: a fresh fleet, the load, the fault switched on at a fixed point and off again later,
//! and the row's figures: outcomes tallied and the times the affected ranks left and rejoined
//! selection.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use rankgate_sim::sim::SimEngine;
use tokio::time::Instant;

use crate::{fault::*, fleet::*, load::*};

/// The fault starts this long into the load (telemetry and traffic have settled by then)...
const FAULT_AT: Duration = Duration::from_millis(1500);
/// ...and is cleared this long after it started...
const FAULT_FOR: Duration = Duration::from_secs(3);
/// ...and the load goes on this long after that, to see the ranks come back.
const AFTER: Duration = Duration::from_secs(3);

/// One row of the table.
#[derive(Debug, Default)]
pub struct Row {
    pub name: &'static str,
    pub title: &'static str,
    pub sent: usize,
    pub ok: usize,
    pub retried: u64,
    pub retries_refused: u64,
    pub ejections: u64,
    pub failed_before_first_byte: BTreeMap<String, usize>,
    pub cut_error_event: usize,
    pub cut_no_done: usize,
    pub client_timeouts: usize,
    /// Generation POSTs the engines received (every attempt that reached one).
    pub engine_posts: u64,
    pub to_eject: Option<Duration>,
    pub eject_kinds: Vec<String>,
    pub to_available: Option<Duration>,
    pub to_traffic: Option<Duration>,
    pub in_flight_end: Option<u64>,
    pub engine_open_end: Option<u64>,
    pub notes: Vec<String>,
    pub wall: Duration,
}

impl Row {
    pub fn failed_total(&self) -> usize {
        self.failed_before_first_byte.values().sum()
    }
}

/// Runs one fault against a fresh fleet.
pub async fn run(fault: Fault) -> Row {
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

/// The rows of a sample that belong to the affected engines.
fn affected_rows<'a>(s: &'a Sample, urls: &[String]) -> Vec<&'a SampleRow> {
    s.rows.iter().filter(|r| urls.contains(&r.0)).collect()
}

/// Fills the timing columns from the `/workers` samples and the responses.
pub fn timing(
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
