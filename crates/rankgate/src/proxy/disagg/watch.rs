//! A disaggregated request whose client leaves before its answer: where it was (the prefill
//! leg, between the legs, the decode leg) counted in `rankgate_pd_abandoned{stage}`, and its
//! access log line written here (status 499, as nginx logs a client that closed its request),
//! since `respond` only logs answers it got. A request's future is dropped when its client
//! leaves, and this guard with it.
//!
//! Each leg's attempts are counted here too, every round of the legs included, for the access
//! line of whatever the request's end is.

use std::sync::Arc;

use tokio::time::Instant;

use crate::metrics::{PdCounts, PdStage};
use crate::proxy::error::ProxyError;
use crate::proxy::layer::Answer;

/// Attempts on ranks each leg made so far.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Tally {
    pub prefill: u32,
    pub decode: u32,
}

impl Tally {
    pub fn total(self) -> u32 {
        self.prefill + self.decode
    }
}

/// The attempts an answer of one leg took (the retry layer notes them on it).
pub(super) fn attempts_of(answer: &Answer) -> u32 {
    match answer {
        Ok(resp) => resp.body().holds.attempts.max(1),
        Err(e) => e.attempts(),
    }
}

/// Stamps the request's attempts (both legs) on its answer, for the access log.
pub(super) fn stamp(mut answer: Answer, tally: Tally) -> Answer {
    match &mut answer {
        Ok(resp) => {
            let holds = &mut resp.body_mut().holds;
            holds.attempts = tally.total();
            if let Some(p) = &mut holds.prefill {
                p.prefill_attempts = tally.prefill;
                p.decode_attempts = tally.decode;
            }
        }
        Err(ProxyError::At { attempts, .. }) => *attempts = tally.total(),
        Err(_) => {}
    }
    answer
}

/// What the access line of an abandoned request says besides its stage.
struct Line {
    method: http::Method,
    path: String,
    model: Option<String>,
    request_id: Option<String>,
    started: Instant,
}

/// Counts (and logs) the request as abandoned at its stage when dropped before
/// [`Watch::done`].
pub(super) struct Watch {
    pd: Arc<PdCounts>,
    stage: PdStage,
    armed: bool,
    pub tally: Tally,
    /// The prefill rank of the last prefill leg that answered.
    pub prefill_worker: Option<Arc<str>>,
    /// `None` with `server.access_log` off.
    line: Option<Box<Line>>,
}

impl Watch {
    pub fn new(pd: &Arc<PdCounts>, head: &http::request::Parts, client: &[u8], log: bool) -> Watch {
        let line = log.then(|| {
            Box::new(Line {
                method: head.method.clone(),
                path: head.uri.path().to_string(),
                model: crate::scan::json_member(client, "model")
                    .ok()
                    .flatten()
                    .map(|m| m.into_owned()),
                request_id: (head.headers.get(crate::proxy::identity::REQUEST_ID))
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string),
                started: Instant::now(),
            })
        });
        Watch {
            pd: pd.clone(),
            stage: PdStage::Prefill,
            armed: true,
            tally: Tally::default(),
            prefill_worker: None,
            line,
        }
    }

    /// Where the request is now.
    pub fn at(&mut self, stage: PdStage) {
        self.stage = stage;
    }

    /// The request has its answer: nothing more to count here.
    pub fn done(&mut self) {
        self.armed = false;
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.pd.abandoned(self.stage);
        let Some(l) = self.line.take() else {
            return;
        };
        // The leg in flight made one attempt at least, not yet counted.
        let mut tally = self.tally;
        match self.stage {
            PdStage::Prefill => tally.prefill += 1,
            PdStage::Decode => tally.decode += 1,
            PdStage::Between => {}
        }
        tracing::info!(
            target: "rankgate::access",
            method = %l.method,
            path = %l.path,
            model = l.model.as_deref().unwrap_or("-"),
            worker = "-",
            status = 499u16,
            bytes = 0u64,
            duration_ms = l.started.elapsed().as_secs_f64() * 1e3,
            request_id = l.request_id.as_deref().unwrap_or("-"),
            attempts = tally.total(),
            prefill_attempts = tally.prefill,
            decode_attempts = tally.decode,
            prefill_worker = self.prefill_worker.as_deref(),
            abandoned = self.stage.as_str(),
            "request"
        );
    }
}
