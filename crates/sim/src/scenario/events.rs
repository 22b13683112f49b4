//! A scenario's timeline: at given times, ranks go dark and engines start or stop misbehaving
//! (the simulator's fault knobs), so a run shows how the router copes while it happens.

use std::sync::Arc;

use serde::Deserialize;
use tokio::time::Instant;

use crate::sim::{check_percent, check_status, SimEngine};
use rankgate::config::HumanDuration;

/// A count, or the word "off" to clear it (TOML has no null).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Limit {
    Count(u64),
    Word(String),
}

impl Limit {
    fn value(&self) -> Result<Option<u64>, String> {
        match self {
            Limit::Count(n) => Ok(Some(*n)),
            Limit::Word(w) if w == "off" => Ok(None),
            Limit::Word(w) => Err(format!("takes a count or \"off\", got {w:?}")),
        }
    }
}

/// At `at`: `dark` replaces the set of ranks publishing no telemetry, numbered in fleet order
/// (the scenario's rank N, see [`super::Scenario::ranks`]), on every engine;
/// the fault keys (and `restart`) change engine `engine` (index into `[[engines]]`), or every
/// engine without it.
/// Keys left out leave that knob as it was.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Event {
    pub at: HumanDuration,
    pub dark: Option<Vec<usize>>,
    pub engine: Option<usize>,
    /// Status of the failing share; 503 when only `fail_percent` is given.
    pub fail_status: Option<u16>,
    /// Share of OpenAI API requests failing at once, in percent; 0 stops failing.
    pub fail_percent: Option<f64>,
    pub hang_requests: Option<bool>,
    pub hang_metrics: Option<bool>,
    pub hang_models: Option<bool>,
    pub health_status: Option<u16>,
    /// Die once this many more requests are admitted, or "off".
    pub die_after: Option<Limit>,
    /// Stall generation after this many tokens, or "off".
    pub stall_after_tokens: Option<Limit>,
    /// Die now, like `kill -9`.
    #[serde(default)]
    pub kill: bool,
    /// Restart the engine's caches now, as a restarted engine process has them: every rank's
    /// prefix cache empties and its KV-event stream starts again at sequence 0 with
    /// `AllBlocksCleared` (see `SimEngine::restart`; requests in flight finish, uncached).
    #[serde(default)]
    pub restart: bool,
}

impl Event {
    fn touches_faults(&self) -> bool {
        self.fail_percent.is_some()
            || self.hang_requests.is_some()
            || self.hang_metrics.is_some()
            || self.hang_models.is_some()
            || self.health_status.is_some()
            || self.die_after.is_some()
            || self.stall_after_tokens.is_some()
            || self.kill
            || self.restart
    }

    /// Checks everything that could make applying the event fail, so a run never stops half-way.
    pub(super) fn validate(&self, engines: usize, ranks: usize) -> Result<(), String> {
        if let Some(i) = self.engine.filter(|&i| i >= engines) {
            return Err(format!("engine {i} does not exist ({engines} [[engines]])"));
        }
        if let Some(r) = self.dark.iter().flatten().find(|&&r| r >= ranks) {
            return Err(format!(
                "dark rank {r} does not exist (the fleet has ranks 0..{ranks}, in engine order)"
            ));
        }
        if self.fail_status.is_some() && self.fail_percent.is_none() {
            return Err("fail_status needs fail_percent".into());
        }
        if let Some(p) = self.fail_percent {
            check_percent(p).map_err(|e| format!("fail_percent: {e}"))?;
            check_status(self.fail_status.unwrap_or(503))
                .map_err(|e| format!("fail_status: {e}"))?;
        }
        if let Some(s) = self.health_status {
            check_status(s).map_err(|e| format!("health_status: {e}"))?;
        }
        if let Some(d) = &self.die_after {
            if d.value().map_err(|e| format!("die_after {e}"))? == Some(0) {
                return Err("die_after must be at least 1 (use kill = true to die now)".into());
            }
        }
        if let Some(s) = &self.stall_after_tokens {
            s.value().map_err(|e| format!("stall_after_tokens {e}"))?;
        }
        if self.dark.is_none() && !self.touches_faults() {
            return Err("changes nothing (give `dark` or a fault key)".into());
        }
        if self.engine.is_some() && !self.touches_faults() {
            return Err("`engine` needs a fault key (`dark` applies to every engine)".into());
        }
        Ok(())
    }

    /// Applies the fault keys to one engine. Values were checked by `validate`, so the errors
    /// ignored here cannot happen.
    async fn apply(&self, e: &SimEngine) {
        if let Some(p) = self.fail_percent {
            let _ = e.set_fail(self.fail_status.unwrap_or(503), p);
        }
        if let Some(h) = self.hang_requests {
            e.set_hang_requests(h);
        }
        if let Some(h) = self.hang_metrics {
            e.set_hang_metrics(h);
        }
        if let Some(h) = self.hang_models {
            e.set_hang_models(h);
        }
        if let Some(s) = self.health_status {
            let _ = e.set_health_status(s);
        }
        if let Some(Ok(n)) = self.die_after.as_ref().map(Limit::value) {
            e.die_after(n);
        }
        if let Some(Ok(k)) = self.stall_after_tokens.as_ref().map(Limit::value) {
            e.set_stall_after_tokens(k);
        }
        if self.restart {
            e.restart();
        }
        if self.kill {
            e.kill().await;
        }
    }
}

/// Plays the timeline against the fleet until it ends or `stop` fires. Returns the fleet's
/// prefix-cache counters (queries, hits) right after the last event, for the figures of what
/// came after it.
pub(super) async fn play(
    engines: Arc<Vec<SimEngine>>,
    ranks: Vec<(usize, u32)>,
    mut events: Vec<Event>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Option<(u64, u64)> {
    let mut after = None;
    events.sort_by_key(|e| e.at.0);
    let start = Instant::now();
    for ev in events {
        tokio::select! {
            _ = tokio::time::sleep_until(start + ev.at.0) => {}
            _ = stop.changed() => return after,
        }
        for (i, e) in engines.iter().enumerate() {
            if let Some(dark) = &ev.dark {
                // Each engine darkens its own ranks, as it numbers them.
                let own = dark
                    .iter()
                    .filter_map(|&n| ranks.get(n).filter(|(e, _)| *e == i));
                e.set_dark_ranks(own.map(|(_, r)| *r).collect());
            }
            if ev.engine.is_none_or(|t| t == i) {
                ev.apply(e).await;
            }
        }
        after = Some(
            engines
                .iter()
                .flat_map(|e| e.prefix_cache())
                .fold((0, 0), |(q, h), (a, b)| (q + a, h + b)),
        );
    }
    after
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::Scenario;
    use super::*;

    const BASE: &str = r#"
name = "t"
[[engines]]
flavor = "vllm"
dp_size = 2
[[engines]]
flavor = "sglang"
dp_size = 2
fail_percent = 25
hang_metrics = true
stall_after_tokens = 4
[workload]
rate = 5
requests = 10
duration = "10s"
prompt_tokens = 100
output_tokens = 16
"#;

    fn parse(extra: &str) -> Result<Scenario, String> {
        Scenario::parse(&format!("{BASE}{extra}"), None)
    }

    #[test]
    fn engine_faults_and_fault_events_parse() {
        let s = parse(
            r#"
[[events]]
at = "1s"
engine = 1
fail_status = 500
fail_percent = 100
stall_after_tokens = "off"
[[events]]
at = "2s"
dark = [0]
kill = true
engine = 0
[[events]]
at = "3s"
dark = []
"#,
        )
        .unwrap();
        let e = &s.engines[1];
        assert_eq!((e.fail_status, e.fail_percent), (503, 25.0));
        assert!(e.hang_metrics && !e.hang_requests);
        assert_eq!(e.stall_after_tokens, Some(4));
        assert_eq!(s.engines[0].health_status, 200);
        assert_eq!(
            s.events[0].stall_after_tokens,
            Some(Limit::Word("off".into()))
        );
        assert!(s.events[1].kill);
        assert!(!s.events[1].restart);
        // A fault-only event does not end a dark window.
        let w = s.dark_windows();
        assert_eq!(
            w,
            [(0, Duration::from_secs(2), Duration::from_secs(3))],
            "{w:?}"
        );
    }

    #[test]
    fn bad_fault_keys_are_named() {
        for (extra, want) in [
            (
                "[[events]]\nat = \"1s\"\nengine = 2\nkill = true\n",
                "engine 2 does not exist",
            ),
            (
                "[[events]]\nat = \"1s\"\nfail_percent = 101\n",
                "fail_percent",
            ),
            (
                "[[events]]\nat = \"1s\"\nfail_status = 500\n",
                "needs fail_percent",
            ),
            (
                "[[events]]\nat = \"1s\"\nhealth_status = 700\n",
                "health_status",
            ),
            (
                "[[events]]\nat = \"1s\"\nstall_after_tokens = \"never\"\n",
                "stall_after_tokens",
            ),
            ("[[events]]\nat = \"1s\"\ndie_after = 0\n", "kill = true"),
            ("[[events]]\nat = \"1s\"\n", "changes nothing"),
            (
                "[[events]]\nat = \"1s\"\nengine = 0\ndark = [1]\n",
                "needs a fault key",
            ),
        ] {
            let e = parse(extra).unwrap_err();
            assert!(e.contains("events[0]") && e.contains(want), "{extra}: {e}");
        }
        let e = Scenario::parse(
            &BASE.replace("fail_percent = 25", "fail_percent = -3"),
            None,
        )
        .unwrap_err();
        assert!(e.contains("engines[1]: fail_percent"), "{e}");
        let e = Scenario::parse(&BASE.replace("hang_metrics = true", "die_after = 0"), None)
            .unwrap_err();
        assert!(e.contains("engines[1]: die_after"), "{e}");
    }

    #[test]
    fn restart_events_and_kv_events_engines_parse() {
        let s = parse("[[events]]\nat = \"1s\"\nengine = 0\nrestart = true\n").unwrap();
        assert!(s.events[0].restart && s.events[0].touches_faults());
        let with = BASE.replacen("dp_size = 2", "dp_size = 2\nkv_events = true", 1);
        let s = Scenario::parse(&with, None).unwrap();
        let cfg = s.engines[0].sim_config();
        assert!(cfg.kv_events.is_some() && cfg.prefix_caching);
        assert!(
            s.engines[1].sim_config().kv_events.is_none(),
            "off by default"
        );
        let off = with.replacen(
            "kv_events = true",
            "kv_events = true\nprefix_caching = false",
            1,
        );
        let e = Scenario::parse(&off, None).unwrap_err();
        assert!(
            e.contains("engines[0]: kv_events needs prefix_caching"),
            "{e}"
        );
    }
}
