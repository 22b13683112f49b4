//! The simulated engine's gRPC inference side, flavor-neutral: `Generate` decodes on a rank with
//! the same KV model as the HTTP side (admission reserves prompt + max tokens, one token of KV per
//! decoded token, the decode rate slowed by the batch), `Embed` holds its prompt's KV for the
//! moment it is admitted, and `Abort` ends a running generation with finish reason `abort`.
//! `grpc` maps these onto each flavor's messages.
//!
//! Rank handling follows the real servicers: the request's rank field pins a rank in the numbering
//! the engine validates against (out of range: `INVALID_ARGUMENT` naming the rank and the range),
//! no rank lets the engine pick its least loaded one. A generation runs in its own task that feeds
//! a bounded channel; the task ends when the client drops the stream (the channel closes), so a
//! vanished client frees its KV as an abort does.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tonic::Status;

use super::faults::Open;
use super::{lock, Sim, SEEN_CAP};

/// What the engine saw of one gRPC inference call (`Generate`, `Embed`, `Abort`), for tests.
/// Recorded once the rank is resolved: a rank the engine refuses leaves no record.
#[derive(Debug, Clone, PartialEq)]
pub struct GrpcSeen {
    /// The RPC's name, e.g. `Generate`.
    pub method: &'static str,
    /// The GLOBAL rank that served it; `None` for `Abort`, which no rank serves.
    pub rank: Option<u32>,
    /// The request message exactly as it came off the wire (the gRPC frame's payload), unknown
    /// fields and field order included.
    pub raw: Bytes,
    /// The call's `grpc-timeout` header, as sent.
    pub timeout: Option<String>,
    /// The client's address: calls from one address came over one connection.
    pub peer: Option<std::net::SocketAddr>,
    /// The names of every header (metadata key) received, lowercase.
    pub header_names: Vec<String>,
}

/// The raw payload of a request's (only) gRPC message, which the accept loop puts in the request's
/// extensions before tonic decodes it.
#[derive(Debug, Clone)]
pub(crate) struct RawMessage {
    pub raw: Bytes,
    pub timeout: Option<String>,
    pub peer: Option<std::net::SocketAddr>,
    pub header_names: Vec<String>,
}

/// The payload of the first message of a gRPC request body, if the body holds a whole one.
pub(crate) fn first_message(body: &[u8]) -> Option<Bytes> {
    let len = u32::from_be_bytes(body.get(1..5)?.try_into().ok()?) as usize;
    body.get(5..5 + len).map(Bytes::copy_from_slice)
}

/// One event of a generation, before a flavor frames it.
#[derive(Debug)]
pub(crate) enum Gen {
    Chunk {
        token: u32,
        completion: u32,
    },
    Complete {
        output: Vec<u32>,
        reason: &'static str,
    },
}

/// A generation request as the engine runs it.
pub(crate) struct GenJob {
    pub id: String,
    pub local: usize,
    pub prompt_tokens: u64,
    /// The prompt's KV blocks, with prefix caching on.
    pub blocks: Option<super::prefix::Blocks>,
    pub max_tokens: u64,
    /// Whether chunks are sent; a non-streaming request gets the `Complete` only.
    pub stream: bool,
}

/// Generations running under a request id, each with the switch that aborts it.
#[derive(Default)]
pub(crate) struct Running(HashMap<String, watch::Sender<bool>>);

/// How many aborted ids the engine remembers for [`super::SimEngine::aborted`].
pub(crate) const ABORTED_CAP: usize = 1024;

impl Sim {
    /// The local rank a gRPC request runs on: its pin, else the engine's least loaded rank.
    pub(crate) fn grpc_rank(&self, requested: Option<i32>) -> Result<usize, Status> {
        match requested {
            Some(r) => self.local_rank(r.into()).map_err(Status::invalid_argument),
            None => Ok(self.least_loaded()),
        }
    }

    pub(crate) fn record_grpc(&self, method: &'static str, local: Option<usize>, call: RawMessage) {
        let mut seen = lock(&self.grpc_seen);
        if seen.len() == SEEN_CAP {
            seen.pop_front();
        }
        seen.push_back(GrpcSeen {
            method,
            rank: local.map(|l| self.ranks[l].global),
            raw: call.raw,
            timeout: call.timeout,
            peer: call.peer,
            header_names: call.header_names,
        });
    }

    /// Starts decoding `job` in its own task and returns its events.
    pub(crate) fn generate(self: Arc<Self>, job: GenJob) -> mpsc::Receiver<Gen> {
        let (tx, rx) = mpsc::channel(16);
        let (abort, mut aborted) = watch::channel(false);
        // A second generation under the same id takes the id over, as the last one wins in the
        // engines' own request maps.
        lock(&self.running).0.insert(job.id.clone(), abort.clone());
        let open = Open::new(&self);
        tokio::spawn(async move {
            let _open = open;
            let mut output = Vec::new();
            // A client gone or an abort while the job queues ends it here rather than at its
            // next token; dropping the decode future releases the rank's KV.
            let was_aborted = tokio::select! {
                _ = self.decode_grpc(&job, &tx, &mut output) => false,
                _ = tx.closed() => false,
                _ = aborted.wait_for(|a| *a) => true,
            };
            if was_aborted {
                let reason = "abort";
                let _ = tx.send(Gen::Complete { output, reason }).await;
            }
            let mut running = lock(&self.running);
            if running
                .0
                .get(&job.id)
                .is_some_and(|s| s.same_channel(&abort))
            {
                running.0.remove(&job.id);
            }
        });
        rx
    }

    async fn decode_grpc(&self, job: &GenJob, tx: &mpsc::Sender<Gen>, output: &mut Vec<u32>) {
        let rank = &self.ranks[job.local];
        let mut adm = rank
            .admit_prompt(job.prompt_tokens, job.blocks.as_ref(), job.max_tokens)
            .await;
        self.admitted();
        let prefill = self.prefill_time(job.prompt_tokens - adm.cached_tokens);
        super::pause(prefill).await;
        for i in 0..job.max_tokens {
            if self.faults.stalls_at(i) {
                // Holding `adm` keeps the KV taken, as a wedged request does on a real engine.
                self.hold().await;
                return;
            }
            if i > 0 {
                let running = rank.counts().running.saturating_sub(1) as f64;
                let itl =
                    (1.0 + running * self.cfg.batch_slowdown) / self.cfg.decode_tokens_per_sec;
                super::pause(Duration::from_secs_f64(itl)).await;
            }
            adm.grow();
            let token = 100 + (i % 10) as u32;
            output.push(token);
            if job.stream {
                let completion = output.len() as u32;
                if tx.send(Gen::Chunk { token, completion }).await.is_err() {
                    return;
                }
            }
        }
        let output = output.clone();
        let reason = "length";
        let _ = tx.send(Gen::Complete { output, reason }).await;
    }

    /// How long prefilling `tokens` prompt tokens takes.
    pub(crate) fn prefill_time(&self, tokens: u64) -> Duration {
        Duration::from_secs_f64(tokens as f64 / self.cfg.prefill_tokens_per_sec)
    }

    /// Aborts the generations running under these ids; returns how many there were.
    pub(crate) fn abort<'a>(&self, ids: impl IntoIterator<Item = &'a str>) -> usize {
        let mut n = 0;
        for id in ids {
            let found = lock(&self.running).0.remove(id);
            if let Some(abort) = found {
                abort.send_replace(true);
                n += 1;
            }
            let mut aborted = lock(&self.aborted);
            if aborted.len() == ABORTED_CAP {
                aborted.pop_front();
            }
            aborted.push_back(id.to_string());
        }
        n
    }

    /// An embedding: holds the prompt's KV on its rank for the moment it is admitted.
    pub(crate) async fn embed(&self, local: usize, prompt_tokens: u64) -> Vec<f32> {
        {
            let _adm = self.ranks[local].admit(prompt_tokens, 0).await;
            self.admitted();
        }
        (0..EMBED_DIM)
            .map(|i| i as f32 / EMBED_DIM as f32)
            .collect()
    }
}

/// The dimension of the simulated embeddings.
pub(crate) const EMBED_DIM: usize = 8;

/// A prompt's length in tokens: its token ids, else its text at ~4 characters a token; at least 1.
pub(crate) fn prompt_tokens(ids: usize, text: &str) -> u64 {
    let n = if ids > 0 { ids } else { text.len().div_ceil(4) };
    n.max(1) as u64
}

/// The bytes a gRPC prompt's blocks are hashed over: its token ids (one id, four bytes, is one
/// token), else its text (four bytes a token, as over HTTP).
pub(crate) fn prompt_bytes(ids: &[u32], text: &str) -> Vec<u8> {
    if ids.is_empty() {
        text.as_bytes().to_vec()
    } else {
        ids.iter().flat_map(|id| id.to_le_bytes()).collect()
    }
}
