//! What both flavors' two legs share: which engines each leg may go to ([`Split`]), each leg's
//! request built from the client's ([`Head`]), the decode's answer handed back with its
//! prefill leg, and how each leg's outcome counts.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response};
use http_body_util::BodyExt;

use super::health::{leg_failed, leg_ok};
use super::watch::{stamp, Tally};
use crate::metrics::{PdFailure, PdLeg};
use crate::policy::{Avoid, Leg};
use crate::prompt::PromptTokens;
use crate::proxy::body::ProxyBody;
use crate::proxy::error::{DecodeFailure, DecodeWhy, ProxyError};
use crate::proxy::layer::Answer;
use crate::proxy::shared::Ctx;
use crate::proxy::target::PrefillLeg;
use crate::proxy::trace::Traced;
use crate::upstream::RequestBody;
use crate::worker::{EngineId, Flavor, Member};

/// A request to serve in two legs (set by `select`): the prefill and decode servers that may
/// take each leg, their flavor, and what both legs must avoid besides (the front door, a model
/// no known list has).
#[derive(Debug, Clone)]
pub struct Split {
    pub prefill: Vec<EngineId>,
    pub decode: Vec<EngineId>,
    pub flavor: Flavor,
    pub base: Avoid,
}

impl Split {
    /// What the `leg`'s pick may choose from.
    pub(crate) fn avoid(&self, leg: Leg) -> Avoid {
        let mut avoid = self.base.clone();
        avoid.only(match leg {
            Leg::Prefill => self.prefill.clone(),
            _ => self.decode.clone(),
        });
        avoid.leg = leg;
        avoid
    }
}

/// The client's request head, for building each leg's request.
pub(super) struct Head(pub http::request::Parts);

impl Head {
    /// A leg's request: the client's head with `body`, picked under `avoid`. The prompt's
    /// token ids go with `prompt` (the prefill leg: where the prompt's blocks are held
    /// matters there, not on the decode side, which is sent them).
    pub(super) fn leg(&self, body: Bytes, avoid: Avoid, prompt: bool) -> Request<RequestBody> {
        let p = &self.0;
        let mut req = Request::new(RequestBody::Full(Bytes::new()));
        *req.method_mut() = p.method.clone();
        *req.uri_mut() = p.uri.clone();
        *req.version_mut() = p.version;
        *req.headers_mut() = p.headers.clone();
        (req.headers_mut()).insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        // The body is rankgate's now: whatever encoding the client declared is gone.
        req.headers_mut().remove(header::TRANSFER_ENCODING);
        *req.body_mut() = RequestBody::Full(body);
        let ext = req.extensions_mut();
        if let Some(t) = p.extensions.get::<Traced>() {
            ext.insert(t.clone());
        }
        if let (true, Some(t)) = (prompt, p.extensions.get::<PromptTokens>()) {
            ext.insert(t.clone());
        }
        ext.insert(avoid);
        req
    }
}

/// The decode leg's answer, the client's, carrying what the prefill leg was. Decoded only
/// with a success status: an engine's error is a failed decode leg, whatever it answered.
pub fn answered(ctx: &Ctx, answer: Answer, prefill: PrefillLeg, flavor: Flavor) -> Answer {
    let pd = &ctx.metrics.pd;
    match answer {
        Ok(mut resp) => {
            count_leg(&resp, PdLeg::Decode);
            let worker = resp.body().target.as_ref().map(|t| t.worker.clone());
            if resp.status().is_success() {
                pd.decoded();
                if let Some(w) = &worker {
                    leg_ok(w);
                }
            } else if resp.status().is_server_error() {
                leg_failed(
                    pd,
                    PdLeg::Decode,
                    PdFailure::Status,
                    worker.as_deref(),
                    flavor,
                );
            } else {
                // A 4xx is the client's request refused, no fault of the side.
                pd.failed(PdLeg::Decode, PdFailure::Status);
            }
            resp.body_mut().holds.prefill = Some(Box::new(prefill));
            Ok(resp)
        }
        Err(e) => {
            leg_failed(
                pd,
                PdLeg::Decode,
                failure(&e),
                e.worker().map(|w| &**w),
                flavor,
            );
            Err(e)
        }
    }
}

/// Counts a leg on the rank that answered it.
pub(super) fn count_leg(resp: &Response<ProxyBody>, leg: PdLeg) {
    if let Some(t) = &resp.body().target {
        t.worker.counters.pd_legs[leg as usize].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// How a leg's error counts.
pub(super) fn failure(e: &ProxyError) -> PdFailure {
    match e.root() {
        ProxyError::NoRank(_) | ProxyError::NoRankUnlisted { .. } => PdFailure::NoRank,
        ProxyError::Upstream { .. }
        | ProxyError::StaleConnection { .. }
        | ProxyError::EngineBusy { .. } => PdFailure::Transport,
        ProxyError::Timeout(_) => PdFailure::Timeout,
        ProxyError::PrefillNoParams => PdFailure::NoParams,
        ProxyError::PrefillAnswer(_) => PdFailure::Unreadable,
        ProxyError::PrefillBadParams { .. } => PdFailure::BadParams,
        _ => PdFailure::Other,
    }
}

/// How much of a failed decode's reply is read, and for how long: an error reply is a line.
const REPLY_BYTES: usize = 64 * 1024;
const REPLY_WITHIN: Duration = Duration::from_secs(2);
/// How much of it the error message quotes.
const REPLY_QUOTED: usize = 300;

/// A decode leg that failed: what the decode rank did, which rank, after which prefill leg.
pub(super) struct Failed {
    pub why: DecodeWhy,
    pub worker: Option<Arc<Member>>,
    pub leg: PrefillLeg,
}

impl Failed {
    /// Failed before its first byte in a way a decode rank that pulls anew may not: an error
    /// status, the transport, no answer in time (another prefill may help: its blocks may be
    /// gone with the decode that pulled them).
    pub fn worth_a_new_prefill(&self) -> bool {
        match &self.why {
            DecodeWhy::Answered { status, .. } => status.is_server_error(),
            DecodeWhy::Failed(e) => e.retryable() || matches!(e.root(), ProxyError::Timeout(_)),
        }
    }

    /// The leg found no decode rank at all.
    pub fn no_rank(&self) -> bool {
        matches!(&self.why, DecodeWhy::Failed(e) if matches!(
            e.root(),
            ProxyError::NoRank(_) | ProxyError::NoRankUnlisted { .. }
        ))
    }

    /// The client's answer: the decode's failure, on its rank, with every attempt of both legs.
    pub fn into_answer(self, tally: Tally) -> crate::proxy::layer::Answer {
        let mut leg = self.leg;
        leg.prefill_attempts = tally.prefill;
        leg.decode_attempts = tally.decode;
        leg.decode_failed = true;
        let e = ProxyError::Decode(Box::new(DecodeFailure {
            why: self.why,
            prefill: leg,
        }));
        match self.worker {
            Some(w) => stamp(Err(e.at(&w)), tally),
            None => Err(e),
        }
    }
}

/// The decode leg's answer (from [`answered`]) as the client's, or how it failed: any error
/// status of the decode rank, and any error once the prefill leg was done.
pub(super) async fn judged(answer: Answer, leg: PrefillLeg) -> Result<Answer, Failed> {
    match answer {
        Ok(resp) if resp.status().is_server_error() => {
            let worker = resp.body().target.as_ref().map(|t| t.worker.clone());
            let status = resp.status();
            let reply = reply_of(resp).await;
            Err(Failed {
                why: DecodeWhy::Answered { status, reply },
                worker,
                leg,
            })
        }
        Ok(resp) => Ok(Ok(resp)),
        Err(e) => Err(Failed {
            worker: e.worker().cloned(),
            why: DecodeWhy::Failed(e),
            leg,
        }),
    }
}

/// What a failed decode said: its OpenAI-shaped `error.message` (or FastAPI's `detail`), else
/// its text, quoted short; empty when it said nothing readable in time.
async fn reply_of(resp: Response<ProxyBody>) -> String {
    let limited = http_body_util::Limited::new(resp.into_body(), REPLY_BYTES);
    let bytes = match tokio::time::timeout(REPLY_WITHIN, limited.collect()).await {
        Ok(Ok(c)) => c.to_bytes(),
        _ => return String::new(),
    };
    let said = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| {
            [&v["error"]["message"], &v["message"], &v["detail"]]
                .into_iter()
                .find_map(|m| m.as_str().map(str::to_string))
        })
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    let said = said.trim();
    match said.char_indices().nth(REPLY_QUOTED) {
        Some((cut, _)) => format!("{}...", &said[..cut]),
        None => said.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ExposeWorker;
    use crate::proxy::exposure::Exposure;
    use http::StatusCode;

    fn leg() -> PrefillLeg {
        PrefillLeg {
            worker: "http://10.0.0.1:8000@0".into(),
            took: Duration::from_millis(5),
            decode_started: tokio::time::Instant::now(),
            kv_from: None,
            prefill_attempts: 0,
            decode_attempts: 0,
            decode_failed: false,
        }
    }

    #[tokio::test]
    async fn a_failed_decode_is_told_as_the_decodes_failure_with_both_legs_attempts() {
        let failed = Failed {
            why: DecodeWhy::Answered {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                reply: "KV pull from 10.0.0.9 failed".into(),
            },
            worker: None,
            leg: leg(),
        };
        assert!(failed.worth_a_new_prefill() && !failed.no_rank());
        let tally = Tally {
            prefill: 1,
            decode: 2,
        };
        let e = failed.into_answer(tally).unwrap_err();
        assert_eq!(e.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(e.attempts(), 3);
        let ProxyError::Decode(d) = e.root() else {
            panic!("{e:?}")
        };
        assert!(d.prefill.decode_failed);
        assert_eq!(
            (d.prefill.prefill_attempts, d.prefill.decode_attempts),
            (1, 2)
        );
        // The engine's reply only where the operator lets clients see engines.
        let public = Exposure::new(ExposeWorker::None).error(&e);
        assert_eq!(public, "decode rank failed: 500 Internal Server Error");
        let full = Exposure::new(ExposeWorker::Url).error(&e);
        assert!(full.contains("KV pull from 10.0.0.9 failed"), "{full}");

        let timed_out = Failed {
            why: DecodeWhy::Failed(ProxyError::Timeout(Duration::from_secs(5))),
            worker: None,
            leg: leg(),
        };
        let e = timed_out.into_answer(tally).unwrap_err();
        assert_eq!(e.status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(
            Exposure::new(ExposeWorker::None).error(&e),
            "decode leg failed: the engine sent no response headers within 5000 ms"
        );
        let none = Failed {
            why: DecodeWhy::Failed(ProxyError::NoRank(crate::policy::NoRank::NoneReachable)),
            worker: None,
            leg: leg(),
        };
        assert!(none.no_rank() && !none.worth_a_new_prefill());
    }
}
