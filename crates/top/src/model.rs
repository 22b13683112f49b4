//! What `rankgate top` knows, with no terminal and no network: the rows read from the admin
//! listener's `GET /workers`, requests per second from the deltas of `rankgate_requests_total`
//! between two polls, the flow-control queue ([`super::flow`]), the sort order, the filter,
//! and what to say when the admin stops answering.
//!
//! Kept pure so every rule (a counter reset, a rank that vanished, a filter over model ids, an id
//! too long for 80 columns) is a unit test. The admin document is read leniently: unknown fields
//! are ignored and missing ones are `None`, so a newer or older router still shows what it has.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use tokio::time::Instant;

use super::flow::{self, Objective, Queue};
use super::rates::{request_counts, Rates};

/// A `/workers` document that is not what rankgate's admin listener answers.
#[derive(Debug, thiserror::Error)]
#[error("the admin's /workers is not a JSON array of workers: {0}")]
pub struct WorkersError(#[from] serde_json::Error);

/// One virtual worker as `/workers` reports it; fields the router leaves out are `None`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
pub struct Row {
    pub id: String,
    pub engine: String,
    pub dp_rank: Option<u32>,
    pub flavor: String,
    /// `available`, `fresh` or `unavailable`.
    pub telemetry: String,
    pub reason: Option<String>,
    pub reason_kind: Option<String>,
    pub source: Option<String>,
    pub reachable: Option<bool>,
    pub kv_usage: Option<f64>,
    pub num_running_reqs: Option<u64>,
    pub num_waiting_reqs: Option<u64>,
    pub age_ms: Option<u64>,
    pub in_flight: u64,
    pub consecutive_failures: u64,
    pub models: Vec<String>,
    /// `both`, `prefill` or `decode`: its engine's part in a disaggregated model (absent from
    /// a router older than roles, which has whole engines only).
    pub role: Option<String>,
    /// Where the config and the engine disagree (its configured DP size, say).
    pub engine_note: Option<String>,
    /// What the rank's failures are (absent from a router older than gray failures).
    pub failures: Option<Failures>,
    /// Not in the document: filled from `/metrics` deltas; `None` until two polls saw the rank.
    #[serde(skip)]
    pub req_per_s: Option<f64>,
}

/// A `/workers` row's `failures`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
pub struct Failures {
    /// The kind of the current run of failures: a status (`503`), `transport`, `timeout`,
    /// `hung` or `mixed`; absent after a success.
    pub kind: Option<String>,
    pub hung_requests: u64,
    pub abandoned_before_first_byte: u64,
}

impl Row {
    /// The FAIL column: the rank's consecutive failures and their kind (`5 503`, `3 hung`), so
    /// a rank failing every request never reads as just `ok`; `None` for a rank whose last
    /// request succeeded.
    pub fn fail_cell(&self) -> Option<String> {
        let n = self.consecutive_failures;
        if n == 0 {
            return None;
        }
        let kind = match self.failures.as_ref().and_then(|f| f.kind.as_deref()) {
            Some("transport") => "conn",
            Some("timeout") => "tmo",
            Some("mixed") => "mix",
            Some(k) => k,
            None => "",
        };
        Some(format!("{n} {kind}").trim_end().to_string())
    }

    /// Routable: fresh numbers, or a fresh rank (named by its engine, no load gauges yet).
    pub fn available(&self) -> bool {
        matches!(self.telemetry.as_str(), "available" | "fresh")
    }

    /// A short word for the rank's state: `ok`, `fresh`, or the kind of reason it is
    /// unavailable.
    pub fn state(&self) -> &str {
        if self.telemetry == "fresh" {
            return "fresh";
        }
        if self.available() {
            return "ok";
        }
        match self.reason_kind.as_deref() {
            Some("sources_failed") => "failed",
            Some("not_polled") => "new",
            Some("no_kv_gauge") => "no-kv",
            Some("empty_report") => "empty",
            Some("fleet_rollup") => "rollup",
            Some("shape_unknown") => "unknown",
            Some(kind) => kind,
            None => "down",
        }
    }

    /// `P` for a prefill rank, `D` for a decode rank; `None` for a whole engine's.
    pub fn role_mark(&self) -> Option<char> {
        match self.role.as_deref() {
            Some("prefill") => Some('P'),
            Some("decode") => Some('D'),
            _ => None,
        }
    }

    /// Whether `needle` (already lower case) is in the engine URL, the id, a model id or the
    /// role (so `/prefill` shows one side of a disaggregated fleet).
    fn matches(&self, needle: &str) -> bool {
        let has = |s: &str| s.to_lowercase().contains(needle);
        has(&self.engine)
            || has(&self.id)
            || self.models.iter().any(|m| has(m))
            || self.role.as_deref().is_some_and(has)
    }
}

/// What the rows are ordered by; [`SortKey::next`] cycles through them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SortKey {
    /// Engine URL, then rank number (so `@10` comes after `@9`).
    #[default]
    Id,
    /// Fullest KV cache first; ranks without a figure last.
    Kv,
    /// Most requests in flight first.
    InFlight,
    /// Busiest first.
    ReqPerSec,
    /// Unavailable ranks first, grouped by reason.
    State,
}

impl SortKey {
    pub const ALL: [SortKey; 5] = [
        SortKey::Id,
        SortKey::Kv,
        SortKey::InFlight,
        SortKey::ReqPerSec,
        SortKey::State,
    ];

    pub fn next(self) -> SortKey {
        let i = Self::ALL.iter().position(|k| *k == self).unwrap_or(0);
        Self::ALL[(i + 1) % Self::ALL.len()]
    }

    pub fn prev(self) -> SortKey {
        let i = Self::ALL.iter().position(|k| *k == self).unwrap_or(0);
        Self::ALL[(i + Self::ALL.len() - 1) % Self::ALL.len()]
    }

    pub fn name(self) -> &'static str {
        match self {
            SortKey::Id => "id",
            SortKey::Kv => "kv",
            SortKey::InFlight => "in-flight",
            SortKey::ReqPerSec => "req/s",
            SortKey::State => "state",
        }
    }
}

impl fmt::Display for SortKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Fleet totals over every rank (not only those the filter shows).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Totals {
    pub available: usize,
    pub total: usize,
    /// Mean KV usage over the ranks that report one.
    pub mean_kv: Option<f64>,
    pub in_flight: u64,
    /// `None` until two polls of `/metrics` have been seen.
    pub req_per_s: Option<f64>,
}

/// Why the last poll gave no fresh rows.
#[derive(Debug, Clone, PartialEq)]
pub struct Outage {
    pub error: String,
    /// Polls failed in a row.
    pub failures: u32,
}

/// Everything the view draws, and the keys' effects on it.
#[derive(Debug)]
pub struct State {
    /// The admin listener, as shown in the header.
    pub admin: String,
    pub interval: Duration,
    /// The last rows read, in the admin's (fleet) order, with their rates.
    rows: Vec<Row>,
    rates: Rates,
    flow: Queue,
    /// The flow-control queue by objective from the last `/metrics`; `None` when the router's
    /// flow control is off (or `/metrics` failed).
    queue: Option<Vec<Objective>>,
    /// When the rows were read; `None` before the first good poll.
    pub updated: Option<Instant>,
    /// Set while the admin cannot be read: the rows are the last ones, and stale.
    pub outage: Option<Outage>,
    /// Set when `/metrics` could not be read on the last poll (rates are then unknown).
    pub metrics_error: Option<String>,
    pub sort: SortKey,
    /// Reverses the sort key's natural order.
    pub reversed: bool,
    /// Substring matched against engine URL, id and model ids, case-insensitive; empty shows all.
    pub filter: String,
    /// The filter being typed after `/`, applied on Enter.
    pub editing: Option<String>,
    /// The first visible row, for fleets longer than the screen.
    pub scroll: usize,
}

impl State {
    pub fn new(admin: impl Into<String>, interval: Duration) -> State {
        State {
            admin: admin.into(),
            interval,
            rows: Vec::new(),
            rates: Rates::default(),
            flow: Queue::default(),
            queue: None,
            updated: None,
            outage: None,
            metrics_error: None,
            sort: SortKey::default(),
            reversed: false,
            filter: String::new(),
            editing: None,
            scroll: 0,
        }
    }

    /// A good poll: `workers` is the `/workers` body; `metrics` the `/metrics` text, or why it
    /// could not be read. Rows of ranks that left the fleet simply go. A body that does not
    /// parse is an outage like a refused connection: the last rows stay, marked stale.
    pub fn apply(
        &mut self,
        at: Instant,
        workers: &[u8],
        metrics: Result<&str, String>,
    ) -> Result<(), WorkersError> {
        let mut rows: Vec<Row> = match serde_json::from_slice(workers) {
            Ok(rows) => rows,
            Err(e) => {
                let e = WorkersError(e);
                self.failed(e.to_string());
                return Err(e);
            }
        };
        let rates = match metrics {
            Ok(text) => {
                self.metrics_error = None;
                self.queue = self.flow.update(at, flow::reading(text));
                self.rates.update(at, request_counts(text))
            }
            Err(e) => {
                self.metrics_error = Some(e);
                self.rates.reset();
                self.flow.reset();
                self.queue = None;
                None
            }
        };
        for row in &mut rows {
            row.req_per_s = rates.as_ref().map(|r| r.of(&row.id));
        }
        self.rows = rows;
        self.updated = Some(at);
        self.outage = None;
        Ok(())
    }

    /// A failed poll: the rows stay as they were, marked stale by the outage.
    pub fn failed(&mut self, error: String) {
        let failures = self.outage.as_ref().map_or(0, |o| o.failures) + 1;
        self.outage = Some(Outage { error, failures });
    }

    /// Every rank of the last good poll, in fleet order.
    pub fn rows(&self) -> &[Row] {
        &self.rows
    }

    /// The rows the filter keeps, in sort order.
    pub fn visible(&self) -> Vec<&Row> {
        let needle = self.filter.trim().to_lowercase();
        let mut rows: Vec<&Row> = (self.rows.iter())
            .filter(|r| needle.is_empty() || r.matches(&needle))
            .collect();
        rows.sort_by(|a, b| {
            let ord = compare(self.sort, a, b);
            if self.reversed {
                ord.reverse()
            } else {
                ord
            }
        });
        rows
    }

    /// The flow-control queue by objective, highest priority first; `None` when flow control
    /// is off.
    pub fn queue(&self) -> Option<&[Objective]> {
        self.queue.as_deref()
    }

    pub fn totals(&self) -> Totals {
        let kv: Vec<f64> = self.rows.iter().filter_map(|r| r.kv_usage).collect();
        let rates: Vec<f64> = self.rows.iter().filter_map(|r| r.req_per_s).collect();
        Totals {
            available: self.rows.iter().filter(|r| r.available()).count(),
            total: self.rows.len(),
            mean_kv: (!kv.is_empty()).then(|| kv.iter().sum::<f64>() / kv.len() as f64),
            in_flight: self.rows.iter().map(|r| r.in_flight).sum(),
            req_per_s: (!rates.is_empty()).then(|| rates.iter().sum()),
        }
    }

    /// Whether the rows shown are the last ones read before the admin stopped answering.
    pub fn stale(&self) -> bool {
        self.outage.is_some()
    }

    /// Moves the first visible row by `delta`, within what `page` rows on screen can show.
    pub fn scroll_by(&mut self, delta: isize, page: usize) {
        let max = self.visible().len().saturating_sub(page.max(1));
        self.scroll = self.scroll.saturating_add_signed(delta).min(max);
    }
}

/// The natural order of `key` (then by id, so equal rows keep a stable place).
fn compare(key: SortKey, a: &Row, b: &Row) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    let by_id = || {
        (a.engine.as_str(), a.dp_rank, a.id.as_str()).cmp(&(
            b.engine.as_str(),
            b.dp_rank,
            b.id.as_str(),
        ))
    };
    // Descending, with `None` after every figure.
    let desc = |x: Option<f64>, y: Option<f64>| match (x, y) {
        (Some(x), Some(y)) => y.total_cmp(&x),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => Ordering::Equal,
    };
    let first = match key {
        SortKey::Id => Ordering::Equal,
        SortKey::Kv => desc(a.kv_usage, b.kv_usage),
        SortKey::InFlight => b.in_flight.cmp(&a.in_flight),
        SortKey::ReqPerSec => desc(a.req_per_s, b.req_per_s),
        SortKey::State => (a.available(), a.state()).cmp(&(b.available(), b.state())),
    };
    first.then_with(by_id)
}

/// `id` in at most `width` characters, for a column. The scheme goes first; then the path; then
/// the host is cut (marked `…`), keeping `:port@rank`, which tell ranks of one host apart.
pub fn short_id(id: &str, width: usize) -> String {
    let bare = id
        .strip_prefix("http://")
        .or_else(|| id.strip_prefix("https://"))
        .unwrap_or(id);
    let len = |s: &str| s.chars().count();
    if len(bare) <= width {
        return bare.to_string();
    }
    // `@rank` only when all that follows the last `@` is digits, as RankId::parse reads it.
    let (base, rank) = match bare.rsplit_once('@') {
        Some((b, r)) if !r.is_empty() && r.bytes().all(|c| c.is_ascii_digit()) => {
            (b, &bare[b.len()..])
        }
        _ => (bare, ""),
    };
    let (authority, path) = base.split_at(base.find('/').unwrap_or(base.len()));
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !p.is_empty() && p.bytes().all(|c| c.is_ascii_digit()) => {
            (h, &authority[h.len()..])
        }
        _ => (authority, ""),
    };
    let dropped_path = if path.is_empty() { "" } else { "…" };
    let tail = format!("{dropped_path}{port}{rank}");
    if len(host) + len(&tail) <= width {
        return format!("{host}{tail}");
    }
    // Room for at least two characters of host and the `…`; else keep the end of it all.
    match width.checked_sub(len(&tail) + 1) {
        Some(room) if room >= 2 => {
            let head: String = host.chars().take(room).collect();
            format!("{head}…{port}{rank}")
        }
        _ => {
            let keep = width.saturating_sub(1);
            let chars: Vec<char> = bare.chars().collect();
            let tail: String = chars[chars.len().saturating_sub(keep)..].iter().collect();
            if width == 0 {
                String::new()
            } else {
                format!("…{tail}")
            }
        }
    }
}

/// `s` in at most `width` characters, cut at the end with `…`.
pub fn truncate(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        return s.to_string();
    }
    if width == 0 {
        return String::new();
    }
    let mut out: String = s.chars().take(width - 1).collect();
    out.push('…');
    out
}

#[cfg(test)]
mod tests;
