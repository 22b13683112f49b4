//! An engine's model list (`/v1/models`, for `/loads?model=`), read aside from the polls.
//!
//! The list changes rarely and an engine may hang on it while its telemetry answers, so it is
//! read by one owned background task at a time, bounded by the poll timeout: a poll only picks
//! up a finished read and never waits for one. Beside the periodic reads, a round asked by a
//! request for an unlisted model ([`crate::recheck`]) starts a read at once; the reader has
//! answered the round once a read begun after it is done (or at once, when it cannot read).

use std::time::Duration;

use tokio::task::JoinHandle;

use super::client::{fetch, HttpClient};
use crate::catalog::Model;

/// Models are re-read every this many polls (about a minute at the default interval).
const MODELS_EVERY: u64 = 240;
/// After a failed read, polls until the next attempt.
const MODELS_RETRY: u64 = 20;

/// A read of the list, in its own task.
type Read = JoinHandle<Result<Vec<Model>, String>>;

/// One engine's model-list reader. Dropping it aborts a read in flight.
pub struct ModelsReader {
    uri: Option<http::Uri>,
    /// Poll number from which a read is due again.
    next: u64,
    /// The read in flight, with the newest recheck round asked when it began.
    task: Option<(Read, u64)>,
    /// The newest recheck round this reader has answered.
    answered: u64,
    /// Whether the engine answered the last poll: one that comes back (perhaps restarted with
    /// other models) is read again at once.
    was_reachable: bool,
    /// Whether the current run of failed reads was logged (once per run, not per retry).
    warned: bool,
}

impl Drop for ModelsReader {
    fn drop(&mut self) {
        if let Some((t, _)) = self.task.take() {
            t.abort();
        }
    }
}

impl ModelsReader {
    /// `uri` is `None` when the engine URL gave no valid models URI: then nothing is read.
    pub fn new(uri: Option<http::Uri>) -> ModelsReader {
        ModelsReader {
            uri,
            next: 0,
            task: None,
            answered: 0,
            was_reachable: false,
            warned: false,
        }
    }

    /// The newest recheck round this reader has answered.
    pub fn answered(&self) -> u64 {
        self.answered
    }

    /// Called once per poll `n`: returns the list if a read has just finished with one, and
    /// starts the next read when due (first once the engine answers, then every
    /// [`MODELS_EVERY`] polls, [`MODELS_RETRY`] after a failure, and at once for a recheck
    /// round newer than `asked` it has answered).
    pub async fn step(
        &mut self,
        n: u64,
        reachable: bool,
        http: &HttpClient,
        timeout: Duration,
        asked: u64,
    ) -> Option<Vec<Model>> {
        let mut got = None;
        if let Some((task, round)) = self.task.take_if(|(t, _)| t.is_finished()) {
            // A failed read answers its round too: the engine was asked.
            self.answered = self.answered.max(round);
            // Finished, so this await returns at once.
            match task.await {
                Ok(Ok(models)) => {
                    got = Some(models);
                    self.warned = false;
                }
                Ok(Err(why)) if !self.warned => {
                    self.warned = true;
                    let uri = self
                        .uri
                        .as_ref()
                        .map(ToString::to_string)
                        .unwrap_or_default();
                    tracing::warn!(%uri, error = %why, "reading the engine's models failed; requests naming a model go to engines known to serve it (an HTTP 401 means engines[].api_key_env is missing or wrong)");
                }
                _ => {}
            }
            self.next = n + if got.is_some() {
                MODELS_EVERY
            } else {
                MODELS_RETRY
            };
        }
        if reachable && !self.was_reachable {
            self.next = n;
        }
        self.was_reachable = reachable;
        let recheck = asked > self.answered;
        if recheck && (!reachable || self.uri.is_none()) {
            // Nothing to read: the round waits for no answer from here.
            self.answered = asked;
        }
        if self.task.is_none() && (n >= self.next || recheck) && reachable {
            if let Some(u) = self.uri.clone() {
                let http = http.clone();
                let task = tokio::spawn(async move {
                    tokio::time::timeout(timeout, read(&http, u))
                        .await
                        .unwrap_or_else(|_| Err(format!("no answer within {timeout:?}")))
                });
                self.task = Some((task, asked));
            }
        }
        got
    }
}

pub(super) async fn read(http: &HttpClient, uri: http::Uri) -> Result<Vec<Model>, String> {
    let body = fetch(http, uri).await.map_err(|f| f.reason)?;
    parse(&body).ok_or_else(|| "the answer is not a model list (no `data` array)".into())
}

/// The models of a `/v1/models` answer; `None` when it is not one (no `data` list).
fn parse(body: &[u8]) -> Option<Vec<Model>> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let data = v.get("data")?.as_array()?;
    Some(
        data.iter()
            .filter_map(|m| {
                let id = m.get("id")?.as_str()?.to_string();
                Some(Model {
                    id,
                    entry: m.clone(),
                })
            })
            .collect(),
    )
}
