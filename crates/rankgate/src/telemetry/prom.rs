//! Prometheus text exposition: a lenient, hand-written reader of the few series rankgate needs,
//! and their projection onto an engine's ranks.
//!
//! Hand-written because engine metric names contain `:` (`vllm:kv_cache_usage_perc`), which the
//! `prometheus-parse` crate silently drops. Lenient because a scrape is someone else's output: one
//! malformed line is counted and skipped, it does not void the other ranks' numbers.

use std::borrow::Cow;

use tokio::time::Instant;

use crate::reason::{Reason, ReportKind};
use crate::table::{Fresh, Load, PrefixCounters, RankTelemetry};
use crate::worker::Engine;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Kv,
    Running,
    Waiting,
    /// `vllm:cache_config_info`, whose `kv_cache_size_tokens` label is the capacity.
    CacheInfo,
    /// The engine's prefix-cache counters: prompt tokens looked up, and those found cached.
    PrefixQueries,
    PrefixHits,
    /// Counters of work a rank has done (requests finished, prompt tokens processed): all 0
    /// prove a rank without gauges never ran a request.
    Work,
    /// `vllm:lora_requests_info`: the engine's adapters ([`lora`]), no rank label.
    Lora,
}

/// The series rankgate reads: name, field, and the label that carries the DP rank.
const SERIES: &[(&str, Field, &str)] = &[
    ("vllm:kv_cache_usage_perc", Field::Kv, "engine"),
    // Older vLLM name of the same gauge.
    ("vllm:gpu_cache_usage_perc", Field::Kv, "engine"),
    ("vllm:num_requests_running", Field::Running, "engine"),
    ("vllm:num_requests_waiting", Field::Waiting, "engine"),
    ("vllm:cache_config_info", Field::CacheInfo, "engine"),
    (
        "vllm:prefix_cache_queries_total",
        Field::PrefixQueries,
        "engine",
    ),
    ("vllm:prefix_cache_hits_total", Field::PrefixHits, "engine"),
    ("vllm:request_success_total", Field::Work, "engine"),
    ("vllm:prompt_tokens_total", Field::Work, "engine"),
    ("vllm:lora_requests_info", Field::Lora, "engine"),
    ("sglang:token_usage", Field::Kv, "dp_rank"),
    ("sglang_token_usage", Field::Kv, "dp_rank"),
    ("sglang:num_running_reqs", Field::Running, "dp_rank"),
    ("sglang_num_running_reqs", Field::Running, "dp_rank"),
    ("sglang:num_queue_reqs", Field::Waiting, "dp_rank"),
    ("sglang_num_queue_reqs", Field::Waiting, "dp_rank"),
];

/// Raw values of one rank (or of the whole engine) as they appear in the scrape.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    pub kv: Option<f64>,
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    pub capacity_tokens: Option<f64>,
    pub prefix_queries: Option<f64>,
    pub prefix_hits: Option<f64>,
    /// The sum of the rank's work counters (see `Field::Work`), when it has any.
    pub work: Option<f64>,
}

/// What one scrape says, keyed by the rank label's value.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scrape {
    /// In rank order. A sorted list, not a map: samples come rank after rank, so the next one's
    /// place is found at or beside the last one's (a map lookup was a sixth of the parse).
    pub per_rank: Vec<(u32, Series)>,
    /// Series with no rank label at all: the engine-wide figures.
    pub unlabelled: Option<Series>,
    /// Lines of interesting series that could not be read.
    pub bad_lines: usize,
    /// vLLM's LoRA gauge, its newest series.
    pub lora: Option<lora::LoraGauge>,
}

/// One sample's labels, borrowed from the scrape unless a value had escapes to undo.
type Labels<'a> = Vec<(&'a str, Cow<'a, str>)>;

/// Reads the series rankgate needs out of a `/metrics` body.
///
/// Runs for every engine on every poll (256 times a second for 64 engines at 250 ms), so lines of
/// other series are skipped on their name alone and a sample's labels are borrowed, not copied.
pub fn parse(text: &str) -> Scrape {
    let mut out = Scrape::default();
    let mut labels: Labels = Vec::new();
    let mut last = 0;
    for line in text.split('\n') {
        let line = line.trim_ascii();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line
            .bytes()
            .position(|b| matches!(b, b'{' | b' ' | b'\t'))
            .unwrap_or(line.len());
        let name = &line[..name_end];
        let Some(&(_, field, rank_label)) = SERIES.iter().find(|(n, _, _)| *n == name) else {
            continue;
        };
        labels.clear();
        match parse_sample(&line[name_end..], &mut labels) {
            Some(value) => out.add(field, rank_label, &labels, value, &mut last),
            None => out.bad_lines += 1,
        }
    }
    out
}

impl Scrape {
    /// The series of `rank`, if the scrape has one.
    pub fn rank(&self, rank: u32) -> Option<&Series> {
        let i = self
            .per_rank
            .binary_search_by_key(&rank, |(r, _)| *r)
            .ok()?;
        Some(&self.per_rank[i].1)
    }

    /// The series of `rank`, added in order if new; `last` is where the previous sample went.
    fn rank_mut(&mut self, rank: u32, last: &mut usize) -> &mut Series {
        let at = |i: usize| self.per_rank.get(i).map(|(r, _)| *r);
        let i = if at(*last) == Some(rank) {
            *last
        } else if at(*last + 1) == Some(rank) {
            *last + 1
        } else {
            match self.per_rank.binary_search_by_key(&rank, |(r, _)| *r) {
                Ok(i) => i,
                Err(i) => {
                    self.per_rank.insert(i, (rank, Series::default()));
                    i
                }
            }
        };
        *last = i;
        &mut self.per_rank[i].1
    }

    fn add(
        &mut self,
        field: Field,
        rank_label: &str,
        labels: &Labels,
        value: f64,
        last: &mut usize,
    ) {
        if field == Field::Lora {
            if !lora::LoraGauge::keep_newest(&mut self.lora, labels, value) {
                self.bad_lines += 1;
            }
            return;
        }
        let label = |k: &str| labels.iter().find(|(n, _)| *n == k).map(|(_, v)| &**v);
        let series = match label(rank_label) {
            Some(r) => match r.parse::<u32>() {
                Ok(rank) => self.rank_mut(rank, last),
                Err(_) => {
                    self.bad_lines += 1;
                    return;
                }
            },
            None => self.unlabelled.get_or_insert_with(Series::default),
        };
        // Several series for one rank (e.g. one per model) add up for counts; KV takes the fullest.
        match field {
            Field::Kv => series.kv = Some(series.kv.map_or(value, |v| v.max(value))),
            Field::Running => series.running = Some(series.running.unwrap_or(0.0) + value),
            Field::Waiting => series.waiting = Some(series.waiting.unwrap_or(0.0) + value),
            Field::PrefixQueries => {
                series.prefix_queries = Some(series.prefix_queries.unwrap_or(0.0) + value)
            }
            Field::PrefixHits => {
                series.prefix_hits = Some(series.prefix_hits.unwrap_or(0.0) + value)
            }
            Field::Work => series.work = Some(series.work.unwrap_or(0.0) + value),
            Field::Lora => {}
            Field::CacheInfo => {
                if let Some(tokens) = label("kv_cache_size_tokens").and_then(|t| t.parse().ok()) {
                    series.capacity_tokens = Some(tokens);
                }
            }
        }
    }
}

/// Parses `{labels} value [timestamp]` (the part after the metric name) into `labels` and the
/// value.
fn parse_sample<'a>(rest: &'a str, labels: &mut Labels<'a>) -> Option<f64> {
    let b = rest.as_bytes();
    // Past blanks (and, between labels, commas) from `i`.
    let skip = |mut i: usize, commas: bool| {
        while i < b.len() && (matches!(b[i], b' ' | b'\t') || (commas && b[i] == b',')) {
            i += 1;
        }
        i
    };
    let mut i = skip(0, false);
    if b.get(i) == Some(&b'{') {
        i += 1;
        loop {
            i = skip(i, true);
            if b.get(i) == Some(&b'}') {
                i += 1;
                break;
            }
            let eq = i + b[i..].iter().position(|&c| c == b'=')?;
            let key = rest[i..eq].trim_ascii();
            i = skip(eq + 1, false);
            if b.get(i) != Some(&b'"') {
                return None;
            }
            let (value, used) = read_quoted(&rest[i + 1..])?;
            labels.push((key, value));
            i += 1 + used;
        }
    }
    let mut parts = rest[i..].split_ascii_whitespace();
    let value = parse_value(parts.next()?)?;
    // An optional timestamp may follow; anything beyond it is malformed.
    if parts.nth(1).is_some() {
        return None;
    }
    Some(value)
}

/// Reads a label value up to its closing quote, undoing `\\`, `\"` and `\n`; borrowed when
/// there is nothing to undo. Returns the value and how many bytes were consumed including the
/// closing quote.
fn read_quoted(s: &str) -> Option<(Cow<'_, str>, usize)> {
    let end = s.bytes().position(|b| b == b'"' || b == b'\\')?;
    if s.as_bytes()[end] == b'"' {
        return Some((Cow::Borrowed(&s[..end]), end + 1));
    }
    let mut out = String::from(&s[..end]);
    let mut chars = s[end..].char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((Cow::Owned(out), end + i + 1)),
            '\\' => match chars.next()?.1 {
                'n' => out.push('\n'),
                other => out.push(other),
            },
            _ => out.push(c),
        }
    }
    None
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

/// Projects a scrape onto each of the engine's ranks, in rank order. Each rank gets exactly the
/// series labelled with its own global rank; a rank with none is Unavailable, never zero, unless
/// its engine reported its DP size itself (then it is fresh: see [`crate::table::Fresh`]). A
/// rank with series but no KV gauge is fresh too.
pub fn project(scrape: &Scrape, engine: &Engine, sampled_at: Instant) -> Vec<RankTelemetry> {
    engine
        .ranks()
        .map(|rank| {
            if !scrape.per_rank.is_empty() {
                let series = scrape.rank(rank).or_else(|| {
                    // External-LB mode: a one-rank server may label its only engine "0" whatever
                    // its global rank is; there the endpoint itself is the key.
                    (engine.dp_size == 1 && scrape.per_rank.len() == 1)
                        .then(|| scrape.per_rank.first().map(|(_, s)| s))
                        .flatten()
                });
                match series {
                    Some(s) => to_telemetry(s, Some(rank), sampled_at),
                    None if engine.names_rank(rank) => {
                        RankTelemetry::Available(Load::fresh(Fresh::Unproven, None, sampled_at))
                    }
                    None => RankTelemetry::unavailable(Reason::Absent {
                        rank,
                        report: ReportKind::Metrics,
                    }),
                }
            } else if let Some(s) = &scrape.unlabelled {
                to_telemetry(s, None, sampled_at)
            } else {
                RankTelemetry::unavailable(Reason::NoKvGauge { rank: None })
            }
        })
        .collect()
}

/// One series as a rank's telemetry; `rank` is `None` for the engine-wide (unlabelled) series.
fn to_telemetry(s: &Series, rank: Option<u32>, sampled_at: Instant) -> RankTelemetry {
    let aggregate = rank.is_none();
    let invalid = |problem| RankTelemetry::unavailable(Reason::Invalid { rank, problem });
    let capacity_tokens = s
        .capacity_tokens
        .filter(|c| c.is_finite() && *c >= 1.0)
        .map(|c| c as u64);
    let Some(kv) = s.kv else {
        // A rank's own series without any of its load gauges: fresh (the engine-wide figure
        // has no such excuse, nor a rank whose other gauges are there). Work counters at 0
        // prove it idle; NaN or negative ones prove nothing.
        if rank.is_none() || s.running.is_some() || s.waiting.is_some() {
            return RankTelemetry::unavailable(Reason::NoKvGauge { rank });
        }
        let fresh = match s.work {
            Some(0.0) => Fresh::Idle,
            _ => Fresh::Unproven,
        };
        return RankTelemetry::Available(Load::fresh(fresh, capacity_tokens, sampled_at));
    };
    if !(0.0..=1.0).contains(&kv) {
        // NaN fails `contains` too.
        return invalid(format!("KV usage {kv} must be within [0, 1]"));
    }
    let count = |name: &str, v: Option<f64>| -> Result<Option<u32>, String> {
        match v {
            None => Ok(None),
            Some(x) if x.is_finite() && x >= 0.0 && x <= u32::MAX as f64 => Ok(Some(x as u32)),
            Some(x) => Err(format!("{name} {x} must be a finite count >= 0")),
        }
    };
    let (running, waiting) = match (count("running", s.running), count("waiting", s.waiting)) {
        (Ok(r), Ok(w)) => (r, w),
        (Err(e), _) | (_, Err(e)) => return invalid(e),
    };
    // Counters are optional extras: a bad one is left out, not held against the rank's load.
    let counter = |v: Option<f64>| v.filter(|x| x.is_finite() && *x >= 0.0).map(|x| x as u64);
    let prefix_cache = match (counter(s.prefix_queries), counter(s.prefix_hits)) {
        (Some(queries), Some(hits)) if hits <= queries => Some(PrefixCounters { queries, hits }),
        _ => None,
    };
    RankTelemetry::Available(Load {
        kv_usage: kv,
        running,
        waiting,
        used_tokens: None,
        capacity_tokens,
        aggregate,
        upstream: None,
        prefix_cache,
        fresh: None,
        sampled_at,
    })
}

pub mod lora;
#[cfg(test)]
mod tests;
