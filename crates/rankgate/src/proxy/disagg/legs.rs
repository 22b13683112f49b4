//! What both flavors' two legs share: which engines each leg may go to ([`Split`]), each leg's
//! request built from the client's ([`Head`]), the decode's answer handed back with its
//! prefill leg, and how each leg's outcome counts.

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response};

use super::health::{leg_failed, leg_ok};
use crate::metrics::{PdFailure, PdLeg};
use crate::policy::{Avoid, Leg};
use crate::prompt::PromptTokens;
use crate::proxy::body::ProxyBody;
use crate::proxy::error::ProxyError;
use crate::proxy::layer::Answer;
use crate::proxy::shared::Ctx;
use crate::proxy::target::PrefillLeg;
use crate::proxy::trace::Traced;
use crate::upstream::RequestBody;
use crate::worker::{EngineId, Flavor};

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
    pub(super) fn avoid(&self, leg: Leg) -> Avoid {
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
