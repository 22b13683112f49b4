//! One engine's KV-event feed (`routing.kv_events`): finds where each of its ranks publishes
//! (`engines[].kv_events`, else the engine's `GET /kv_event_sources`, asked again every
//! [`ASK_AGAIN`] until it answers), reads every rank's events into that rank's index
//! ([`crate::kv`]), keeps each index's bound at the rank's reported KV capacity, and marks a
//! rank whose publisher fell silent while it ran requests. Started and stopped with the
//! engine's poller.
//!
//! The engine's URL decides whom its ranks' events are taken from: the addresses its host
//! resolves to (and `engines[].kv_events_from`) may publish to an endpoint rankgate binds for
//! it, and its `/kv_event_sources` may name no other address for rankgate to bind, nor more
//! ranks than it has ([`feed::trusted`]; refused and logged, naming the engine).

use std::net::IpAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;

use super::client::{fetch, HttpClient};
use crate::kv::feed::{self, RankSource, Reach, SharedWriter};
use crate::kv::listen::{Listeners, Registration};
use crate::table::{RankTelemetry, Table};
use crate::worker::{EngineEntry, Member};

/// Between two asks of an engine's `/kv_event_sources` that failed.
const ASK_AGAIN: Duration = Duration::from_secs(10);
/// Longest wait for an engine's `/kv_event_sources`.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);
/// How often capacities and silence are checked.
const TICK: Duration = Duration::from_secs(1);
/// A rank that ran requests this long without one event is taken as silent.
const SILENT_FOR: u32 = 30;

/// Runs the feed until aborted.
pub(super) async fn feed(
    entry: Arc<EngineEntry>,
    http: HttpClient,
    listeners: Arc<Listeners>,
    table: Arc<Table>,
) {
    let host = host_of(&entry.authority);
    let kv = entry.kv_events.as_deref();
    let configured = kv.and_then(|k| Some((k.endpoint.as_ref()?, &*k.topic)));
    let also_from = kv.map_or(&[][..], |k| &k.from[..]);
    let replay = kv.and_then(|k| k.replay.as_ref());
    let mut logged = String::new();
    let (sources, from) = loop {
        let engine = addresses_of(host).await;
        let found = match configured {
            Some((endpoint, topic)) => feed::from_config(
                endpoint,
                topic,
                replay,
                host,
                entry.start_rank,
                entry.dp_size,
            )
            .map_err(Missing::from),
            None => (ask(&entry, &http, host).await).and_then(|mut s| {
                // engines[].kv_replay (the operator's word) over what the engine says.
                if let Some(r) = replay {
                    for src in &mut s {
                        let offset = src.rank.saturating_sub(entry.start_rank);
                        src.replay = feed::replay_at(r, offset, host).ok();
                    }
                }
                feed::trusted(&s, entry.start_rank, entry.dp_size, &engine)
                    .map(|()| s)
                    .map_err(Missing::from)
            }),
        };
        let found = found.and_then(|s| {
            let binds = s.iter().any(|s| matches!(s.reach, Reach::Bind(_)));
            match binds && engine.is_empty() && also_from.is_empty() {
                true => Err(Missing::from(format!(
                    "no KV events: the engine's host {host} does not resolve, and its events are taken only from its addresses (or engines[].kv_events_from)"
                ))),
                false => Ok(s),
            }
        });
        match found {
            Ok(s) => {
                let from: Arc<[IpAddr]> = (engine.iter()).chain(also_from).copied().collect();
                break (s, from);
            }
            Err(Missing { why, off }) => {
                for m in entry.members.iter() {
                    let writer = feed::writer(&m.kv);
                    let mut w = feed::lock(&writer);
                    match off {
                        true => w.off(&why),
                        false => w.lost(&why),
                    }
                }
                // Once per reason, not every ASK_AGAIN.
                if why != logged {
                    tracing::warn!(engine = %entry.url, "KV events: {why}");
                    logged = why;
                }
                if configured.is_some() && !logged.contains("does not resolve") {
                    // A configured endpoint that cannot work will not start working.
                    return;
                }
                tokio::time::sleep(ASK_AGAIN).await;
            }
        }
    };
    let mut tasks = JoinSet::new();
    let mut held: Vec<Registration> = Vec::new();
    let mut ranks: Vec<(Arc<Member>, SharedWriter, u64, u32)> = Vec::new();
    for m in entry.members.iter() {
        let writer = feed::writer(&m.kv);
        let Some(src) = sources.iter().find(|s| Some(s.rank) == m.id.rank) else {
            feed::lock(&writer).off("the engine publishes no KV events for this rank: its GET /kv_event_sources leaves the rank out (events off there, or not published over ZeroMQ)");
            continue;
        };
        feed::lock(&writer).set_replay(src.replay.as_ref().map(|r| r.addr.clone()));
        start(src, &from, &writer, &listeners, &mut tasks, &mut held).await;
        ranks.push((m.clone(), writer, 0, 0));
    }
    let mut tick = tokio::time::interval(TICK);
    loop {
        tick.tick().await;
        let snap = table.snapshot.load();
        for (member, writer, last_messages, silent) in &mut ranks {
            let Some(w) = (snap.fleet.workers.iter_enumerated())
                .find(|(_, s)| s.key == member.key)
                .map(|(w, _)| w)
            else {
                continue;
            };
            let RankTelemetry::Available(load) = &snap.ranks[w].telemetry else {
                continue;
            };
            let mut wr = feed::lock(writer);
            if let Some(cap) = load.capacity_tokens {
                wr.set_capacity_tokens(cap);
            }
            let messages = member.kv.counts.messages.load(Relaxed);
            let busy = load.running.is_some_and(|r| r > 0);
            *silent = if busy && messages == *last_messages {
                *silent + 1
            } else {
                0
            };
            *last_messages = messages;
            if *silent == SILENT_FOR {
                wr.lost(&format!(
                    "no KV events for {SILENT_FOR} s while the rank ran requests"
                ));
            }
        }
    }
}

async fn start(
    src: &RankSource,
    from: &Arc<[IpAddr]>,
    writer: &SharedWriter,
    listeners: &Listeners,
    tasks: &mut JoinSet<()>,
    held: &mut Vec<Registration>,
) {
    match &src.reach {
        Reach::Connect(addr) => {
            tasks.spawn(feed::connect_rank(
                addr.clone(),
                src.topic.clone(),
                writer.clone(),
            ));
        }
        Reach::Bind(addr) => match listeners
            .register(*addr, src.topic.clone(), src.rank, from.clone(), writer)
            .await
        {
            Ok(r) => {
                feed::lock(writer).lost(&format!("waiting for the engine to connect to {addr}"));
                held.push(r);
            }
            Err(why) => feed::lock(writer).lost(&why),
        },
    }
}

/// Why an engine's ranks have no event sources (yet).
struct Missing {
    why: String,
    /// No events will come until the engine or the config changes (the engine has no
    /// `/kv_event_sources` and none is configured): its ranks say `off`, not a wait.
    off: bool,
}

impl From<String> for Missing {
    fn from(why: String) -> Missing {
        Missing { why, off: false }
    }
}

/// The engine's `/kv_event_sources`, read.
async fn ask(
    entry: &EngineEntry,
    http: &HttpClient,
    host: &str,
) -> Result<Vec<RankSource>, Missing> {
    let uri: http::Uri = format!("{}/kv_event_sources", entry.url)
        .parse()
        .map_err(|e| Missing::from(format!("/kv_event_sources: {e}")))?;
    let http = http.with_key(entry.api_key.clone());
    // An engine that accepts and never answers must not hold the feed: asked again later.
    let answer = tokio::time::timeout(ASK_TIMEOUT, fetch(&http, uri))
        .await
        .map_err(|_| {
            Missing::from(format!(
                "no KV-event sources: GET /kv_event_sources: no answer within {} s",
                ASK_TIMEOUT.as_secs()
            ))
        })?;
    match answer {
        Ok(body) => feed::from_sources(&body, host).map_err(Missing::from),
        // No such route: an engine started without `--kv-events-config` (or an SGLang one,
        // which has no such route at all).
        Err(f) if f.status == Some(http::StatusCode::NOT_FOUND) => Err(Missing {
            why: format!(
                "no kv_events configured for this engine: GET /kv_event_sources: {} (set engines[].kv_events, or start the engine with --kv-events-config)",
                f.reason
            ),
            off: true,
        }),
        Err(f) => Err(Missing::from(format!(
            "no KV-event sources: GET /kv_event_sources: {} (set engines[].kv_events, or start the engine with --kv-events-config)",
            f.reason
        ))),
    }
}

/// The addresses the engine's host resolves to, canonical (an IPv4-mapped IPv6 address as
/// IPv4); empty when it does not resolve within [`ASK_TIMEOUT`].
async fn addresses_of(host: &str) -> Vec<IpAddr> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return vec![ip.to_canonical()];
    }
    match tokio::time::timeout(ASK_TIMEOUT, tokio::net::lookup_host((host, 0))).await {
        Ok(Ok(found)) => {
            let mut ips: Vec<IpAddr> = found.map(|a| a.ip().to_canonical()).collect();
            ips.sort();
            ips.dedup();
            ips
        }
        _ => Vec::new(),
    }
}

/// The host of an authority `host:port` (`[v6]:port`).
fn host_of(authority: &str) -> &str {
    let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

#[cfg(test)]
mod tests {
    #[test]
    fn hosts_come_out_of_authorities() {
        assert_eq!(super::host_of("10.0.0.5:8000"), "10.0.0.5");
        assert_eq!(super::host_of("[::1]:8000"), "::1");
        assert_eq!(super::host_of("engine.local:80"), "engine.local");
    }
}
