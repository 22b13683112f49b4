//! Multi-turn chat sessions: each session opens with a system prompt (shared by every session of
//! its group), and turn k sends the system prompt, every earlier user and assistant message, and a
//! new user message. A session sends its next turn once the previous answer has arrived, plus a
//! think time; sessions start at Poisson times (open loop) or N at a time (closed loop).
//!
//! Each message is serialized once and kept as text, so turn k+1's `messages` JSON starts with
//! exactly the bytes of turn k's (minus the closing bracket): a router hashing the raw bytes of
//! `messages` and an engine's prefix cache both see the conversation's history as a shared prefix.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::text::{answer, mix, words};
use super::{de_duration, one, Arrivals, Dist, ErrorKind, HttpClient, Outcome, Workload};

/// The shape of a session workload (`--sessions N --turns M`, or `[workload.sessions]`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sessions {
    /// How many sessions.
    pub count: usize,
    /// Turns (requests) per session.
    pub turns: usize,
    /// Length of the system prompt.
    pub system_tokens: u64,
    /// Distinct system prompts: session i uses prompt i mod this, so each is shared by a group.
    #[serde(default = "one_prompt")]
    pub system_prompts: usize,
    /// Length of each new user message.
    pub user_tokens: Dist,
    /// Mean pause between an answer and the session's next turn (exponentially distributed).
    #[serde(default, deserialize_with = "de_duration")]
    pub think_time: Duration,
}

fn one_prompt() -> usize {
    1
}

impl Sessions {
    /// Everything that would make a run meaningless, named.
    pub fn validate(&self) -> Result<(), String> {
        if self.count == 0 || self.turns == 0 {
            return Err("sessions: `count` and `turns` must be at least 1".into());
        }
        if self.system_prompts == 0 {
            return Err("sessions: `system_prompts` must be at least 1".into());
        }
        Ok(())
    }

    /// Requests the sessions send at most.
    pub fn requests(&self) -> usize {
        self.count.saturating_mul(self.turns)
    }
}

/// One conversation: its messages so far, each serialized once.
#[derive(Debug, Clone, Default)]
pub struct Conversation {
    /// The serialized messages joined by commas, without the brackets.
    history: String,
}

impl Conversation {
    pub fn new(system: &str) -> Conversation {
        let mut c = Conversation::default();
        c.push("system", system);
        c
    }

    fn push(&mut self, role: &str, content: &str) {
        if !self.history.is_empty() {
            self.history.push(',');
        }
        self.history
            .push_str(&serde_json::json!({"role": role, "content": content}).to_string());
    }

    /// Adds the user's message; returns the `messages` array to send.
    pub fn ask(&mut self, user: &str) -> String {
        self.push("user", user);
        self.messages()
    }

    /// Adds the assistant's answer.
    pub fn answered(&mut self, text: &str) {
        self.push("assistant", text);
    }

    /// The `messages` array as JSON text.
    pub fn messages(&self) -> String {
        format!("[{}]", self.history)
    }
}

/// The system prompt of group `g`.
fn system_prompt(seed: u64, g: usize, tokens: u64) -> String {
    format!("system prompt {g}: {}", words(mix(seed, g as u64), tokens))
}

/// A chat body around an already serialized `messages` array, so its bytes stay as they are.
fn chat_body(model: &str, messages: &str, max_tokens: u64, stream: bool) -> Bytes {
    let model = serde_json::Value::from(model);
    Bytes::from(format!(
        "{{\"model\":{model},\"messages\":{messages},\"max_tokens\":{max_tokens},\"stream\":{stream}}}"
    ))
}

/// What session tasks share.
struct Shared {
    client: HttpClient,
    /// The targets, taken in turn request by request (replicas of one router).
    uris: Vec<http::Uri>,
    next_uri: AtomicUsize,
    /// Requests still allowed (the workload's `requests` bound).
    budget: AtomicUsize,
    done: Arc<AtomicUsize>,
    started: Instant,
    deadline: Instant,
    stream: bool,
    output_tokens: Dist,
    seed: u64,
    /// Asks rankgate which rank served each turn (see [`Workload::admin_token`]).
    admin_token: Option<Arc<str>>,
    headers: super::Headers,
}

impl Shared {
    fn take_budget(&self) -> bool {
        self.budget
            .fetch_update(Relaxed, Relaxed, |b| b.checked_sub(1))
            .is_ok()
    }
}

/// Runs the sessions of `w` and returns every turn's outcome.
pub(super) async fn run(
    w: &Workload,
    s: &Sessions,
    client: HttpClient,
    uris: Vec<http::Uri>,
    done: Arc<AtomicUsize>,
    started: Instant,
) -> Vec<Outcome> {
    let deadline = started + w.duration;
    let shared = Arc::new(Shared {
        client,
        uris,
        next_uri: AtomicUsize::new(0),
        budget: AtomicUsize::new(w.requests),
        done,
        started,
        deadline,
        stream: w.stream,
        output_tokens: w.output_tokens,
        seed: w.seed,
        admin_token: w.admin_token.clone(),
        headers: w.headers.clone(),
    });
    let live = match w.arrivals {
        Arrivals::Closed(c) => Some(Arc::new(Semaphore::new(c.max(1)))),
        Arrivals::Poisson(_) => None,
    };
    let mut rng = rand::rngs::SmallRng::seed_from_u64(w.seed);
    let mut t = Duration::ZERO;
    let mut tasks: JoinSet<Vec<Outcome>> = JoinSet::new();
    for i in 0..s.count {
        if let Arrivals::Poisson(rate) = w.arrivals {
            if rate > 0.0 {
                let u: f64 = rng.random_range(f64::EPSILON..1.0);
                t += Duration::from_secs_f64(-u.ln() / rate);
            }
            if t >= w.duration {
                break;
            }
            tokio::time::sleep_until(started + t).await;
        }
        let (shared, live, s) = (shared.clone(), live.clone(), s.clone());
        // A conversation stays with one model (one adapter): its history is that model's.
        let model = w.model_of(i).to_string();
        tasks.spawn(async move {
            // Closed loop: a session starts when a live one ends (or never, past the deadline).
            let _permit = match live {
                Some(sem) => match tokio::time::timeout_at(deadline, sem.acquire_owned()).await {
                    Ok(Ok(p)) => Some(p),
                    _ => return Vec::new(),
                },
                None => None,
            };
            session(&shared, &s, i, &model).await
        });
    }
    let mut out = Vec::new();
    while let Some(r) = tasks.join_next().await {
        out.extend(r.unwrap_or_default());
    }
    out
}

/// One session, turn after turn, until its turns, the request budget or the deadline run out,
/// or a turn fails (a user whose request failed does not carry on as if it had been answered).
async fn session(sh: &Shared, s: &Sessions, i: usize, model: &str) -> Vec<Outcome> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(mix(sh.seed, 1 << 40 | i as u64));
    let group = i % s.system_prompts;
    let mut conv = Conversation::new(&system_prompt(sh.seed, group, s.system_tokens));
    let mut out = Vec::with_capacity(s.turns);
    for turn in 0..s.turns {
        if Instant::now() >= sh.deadline || !sh.take_budget() {
            break;
        }
        let user = format!(
            "session {i} turn {turn}: {}",
            words(rng.random(), s.user_tokens.sample(&mut rng))
        );
        let output = sh.output_tokens.sample(&mut rng);
        let body = chat_body(model, &conv.ask(&user), output, sh.stream);
        let n = sh.next_uri.fetch_add(1, Relaxed);
        let uri = sh.uris[n % sh.uris.len()].clone();
        let t0 = Instant::now();
        let token = sh.admin_token.clone();
        let headers = sh.headers.clone();
        let call = one(sh.client.clone(), uri, body, sh.stream, t0, token, headers);
        let mut o = tokio::time::timeout_at(sh.deadline, call)
            .await
            .unwrap_or_else(|_| Outcome::failed(ErrorKind::Deadline, t0.elapsed()));
        o.sent = t0 - sh.started;
        o.asked = output;
        let ok = o.error.is_none();
        out.push(o);
        sh.done.fetch_add(1, Relaxed);
        if !ok {
            break;
        }
        conv.answered(&answer(output));
        if !s.think_time.is_zero() {
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            let think = s.think_time.mul_f64(-u.ln());
            tokio::time::sleep_until((Instant::now() + think).min(sh.deadline)).await;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_turn_starts_with_the_bytes_of_the_last() {
        let mut c = Conversation::new("be \"brief\"");
        let t1 = c.ask("hello");
        c.answered("t0 t1 ");
        let t2 = c.ask("again");
        let v: serde_json::Value = serde_json::from_str(&t2).unwrap();
        assert_eq!(v.as_array().unwrap().len(), 4);
        assert_eq!(v[0]["role"], "system");
        assert_eq!(v[2]["content"], "t0 t1 ");
        assert!(t2.starts_with(&t1[..t1.len() - 1]), "{t1}\n{t2}");
        // The body keeps the array's bytes.
        let body = chat_body("m", &t2, 5, true);
        let body = std::str::from_utf8(&body).unwrap();
        assert!(body.contains(&t2));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["max_tokens"], 5);
    }

    #[test]
    fn groups_share_their_system_prompt() {
        assert_eq!(system_prompt(3, 1, 40), system_prompt(3, 1, 40));
        assert_ne!(system_prompt(3, 0, 40), system_prompt(3, 1, 40));
        let bad = Sessions {
            count: 2,
            turns: 0,
            system_tokens: 10,
            system_prompts: 1,
            user_tokens: Dist::Fixed(5),
            think_time: Duration::ZERO,
        };
        assert!(bad.validate().unwrap_err().contains("turns"));
    }
}
