//! Disaggregated serving: a request for a model whose engines are prefill and decode servers
//! goes in two legs, each through the layers below (retry, pick, observe, send), so each leg's
//! rank is chosen by its own side's load under every rule a whole request's is (unknown, stale,
//! ejected and unavailable ranks passed over, failover before the first byte), and each side's
//! failures are judged against its own ranks.
//!
//! vLLM (NIXL, "pull"): the prefill leg asks a prefill rank for one token with
//! `kv_transfer_params.do_remote_decode`, reads the parameters its answer returns (which blocks,
//! from which engine and side channel), then the decode leg sends the client's request with
//! those parameters to a decode rank, whose answer (streamed or not) is the client's. A prefill
//! answer without parameters is an error, never a decode that silently prefills again. A decode
//! leg that fails before its first byte (a transport failure, or any 5xx: a decode whose KV pull
//! failed answers 500 before any byte, and the client has seen nothing) is failed over to
//! another decode rank only while the prefill server still holds the blocks (its
//! `engines[].kv_lease`, [`crate::config::Engine::kv_lease`]); a decode leg that still failed
//! before its first byte (a decode that pulled the blocks and died, or answered 500 because its
//! pull failed, which the outlier rules do not hold against it) runs once more from a new
//! prefill, within the retry budget. A client that leaves during the prefill leg never gets a
//! decode leg. How each leg ended is counted and judged in `health`.
//!
//! SGLang (bootstrap): both legs at once, see `sglang`.
//!
//! `select` decides which requests are split ([`Split`]); the usual request passes through.
//! A client's own transfer fields never reach an engine (`body`), and a prefill server's are
//! checked before a decode sees them (`kv_params`).

mod body;
pub(crate) mod health;
mod kv_params;
mod legs;
mod sglang;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use tokio::time::Instant;

use super::body::ProxyBody;
use super::error::ProxyError;
use super::layer::{Answer, Below, Step};
use super::read;
use super::retry::Policy;
use super::shared::Ctx;
use super::target::{PrefillLeg, RetryUntil};
use crate::metrics::{PdFailure, PdLeg};
use crate::policy::Leg;
use crate::upstream::RequestBody;
use crate::worker::Flavor;
use health::{leg_failed, leg_ok};
pub use legs::Split;
use legs::{answered, count_leg, failure, Head};

/// A prefill server's answer is one small JSON object: more than this is no prefill answer.
const MAX_PREFILL_ANSWER: usize = 1 << 20;

#[derive(Clone)]
pub struct Disagg<S> {
    inner: S,
    ctx: Ctx,
    /// `server.max_body_bytes`: a body too large to have been kept is read whole here.
    max_body: usize,
    /// `server.response_timeout`, for reading the prefill server's answer.
    answer_within: Duration,
    /// The retry budget a request run again from its prefill draws on.
    retry: Arc<Policy>,
}

impl<S> Disagg<S> {
    pub fn new(
        inner: S,
        ctx: &Ctx,
        max_body: usize,
        answer_within: Duration,
        retry: &Arc<Policy>,
    ) -> Disagg<S> {
        Disagg {
            inner,
            ctx: ctx.clone(),
            max_body,
            answer_within,
            retry: retry.clone(),
        }
    }
}

impl<S> tower::Service<Request<RequestBody>> for Disagg<S>
where
    S: Below<RequestBody> + Clone + Send + 'static,
{
    layer_types!(Step<S::Future>);

    fn call(&mut self, mut req: Request<RequestBody>) -> Self::Future {
        let Some(split) = req.extensions_mut().remove::<Split>() else {
            return Step::Below(self.inner.call(req));
        };
        let legs = self.clone();
        Step::Own(Box::pin(legs.serve(req, split)))
    }
}

impl<S> Disagg<S>
where
    S: Below<RequestBody> + Clone + Send + 'static,
{
    async fn serve(self, req: Request<RequestBody>, split: Split) -> Answer {
        let (parts, body) = req.into_parts();
        let whole = read::whole(body, self.max_body).await?;
        let client = body::client_body(&whole)?;
        let head = Head(parts);
        match split.flavor {
            Flavor::Sglang => {
                let legs = sglang::Legs {
                    ctx: &self.ctx,
                    head: &head,
                    client: &client,
                    retry: &self.retry,
                };
                legs.serve(self.inner.clone(), split).await
            }
            _ => self.vllm(head, client, split).await,
        }
    }

    /// vLLM's two legs, one after the other; once more from a new prefill when the decode leg
    /// failed before its first byte on every decode rank it was failed over to (its prefill's
    /// blocks may be gone with the first decode that pulled them), within the retry budget.
    async fn vllm(mut self, head: Head, client: Bytes, mut split: Split) -> Answer {
        let (answer, redo) = self.vllm_once(&head, &client, &split).await;
        if !redo || !self.retry.withdraw() {
            return answer;
        }
        self.ctx.metrics.retried();
        // The decode rank that failed last is not asked again.
        let failed = match &answer {
            Ok(resp) => resp.body().target.as_ref().map(|t| t.worker.key),
            Err(e) => e.worker().map(|w| w.key),
        };
        if let Some(w) = failed {
            split.base.worker(w);
        }
        drop(answer);
        self.vllm_once(&head, &client, &split).await.0
    }

    /// The two legs once; `true` with a decode that failed before its first byte.
    async fn vllm_once(&mut self, head: &Head, client: &Bytes, split: &Split) -> (Answer, bool) {
        match self.two_legs(head, client, split).await {
            Ok((answer, true)) => {
                let redo = match &answer {
                    Ok(resp) => resp.status().is_server_error(),
                    Err(e) => e.retryable() || matches!(e.root(), ProxyError::Timeout(_)),
                };
                (answer, redo)
            }
            Ok((answer, false)) => (answer, false),
            Err(e) => (Err(e), false),
        }
    }

    /// The two legs: the answer, and whether it is the decode leg's (`Err`: the prefill leg
    /// failed, or the request could not be split).
    async fn two_legs(
        &mut self,
        head: &Head,
        client: &Bytes,
        split: &Split,
    ) -> Result<(Answer, bool), ProxyError> {
        let pd = self.ctx.metrics.pd.clone();
        let started = Instant::now();
        let prefill_req = head.leg(body::prefill(client)?, split.avoid(Leg::Prefill), true);
        // Dropped with this future if the client leaves during the prefill leg: counted, and
        // no decode leg is started.
        let abandoned = Abandoned(Some(pd.clone()));
        let answer = self.inner.call(prefill_req).await;
        let resp = match answer {
            Ok(resp) => resp,
            Err(e) => {
                abandoned.disarm();
                let at = e.worker().cloned();
                leg_failed(
                    &pd,
                    PdLeg::Prefill,
                    failure(&e),
                    at.as_deref(),
                    Flavor::Vllm,
                );
                return Err(e);
            }
        };
        let Some(prefill) = resp.body().target.clone() else {
            abandoned.disarm();
            return Err(ProxyError::Internal(
                "a prefill answer without its rank".into(),
            ));
        };
        count_leg(&resp, PdLeg::Prefill);
        if !resp.status().is_success() {
            // The engine's own error (a 4xx is the client's request, refused): the client
            // reads it as the engine wrote it. 5xx were failed over below already.
            abandoned.disarm();
            match resp.status().is_server_error() {
                true => leg_failed(
                    &pd,
                    PdLeg::Prefill,
                    PdFailure::Status,
                    Some(&prefill.worker),
                    Flavor::Vllm,
                ),
                false => pd.failed(PdLeg::Prefill, PdFailure::Status),
            }
            return Ok((Ok(resp), false));
        }
        let params = read_answer(resp, self.answer_within)
            .await
            .and_then(|answer| body::params(&answer).map(Bytes::copy_from_slice));
        // Untrusted: checked before any decode sees them (a refusal is `bad_params`).
        let params = kv_params::checked(params, &prefill.engine).await;
        abandoned.disarm();
        let params = match params {
            Ok(p) => p,
            Err(e) => {
                let kind = match e {
                    ProxyError::PrefillNoParams => PdFailure::NoParams,
                    ProxyError::PrefillBadParams { .. } => PdFailure::BadParams,
                    _ => PdFailure::Unreadable,
                };
                leg_failed(
                    &pd,
                    PdLeg::Prefill,
                    kind,
                    Some(&prefill.worker),
                    Flavor::Vllm,
                );
                tracing::debug!(worker = %prefill.worker.id_text, error = %e, "prefill leg failed");
                return Err(e.at(&prefill.worker));
            }
        };
        leg_ok(&prefill.worker);
        let prefill_took = started.elapsed();
        pd.prefill_took(prefill_took);
        let decode_started = Instant::now();
        let mut decode_req = head.leg(
            body::decode(client, &params)?,
            split.avoid(Leg::Decode),
            false,
        );
        // Another decode rank may pull the same blocks while the prefill server keeps them.
        let lease = prefill.engine.kv_lease();
        (decode_req.extensions_mut()).insert(RetryUntil(decode_started + lease, true));
        let leg = PrefillLeg {
            worker: prefill.worker.id_text.clone(),
            took: prefill_took,
            decode_started,
            kv_from: body::kv_source(&params),
        };
        let answer = self.inner.call(decode_req).await;
        Ok((answered(&self.ctx, answer, leg, Flavor::Vllm), true))
    }
}

/// The prefill server's answer, whole (it is small), within `within`.
async fn read_answer(resp: Response<ProxyBody>, within: Duration) -> Result<Bytes, ProxyError> {
    let limited = http_body_util::Limited::new(resp.into_body(), MAX_PREFILL_ANSWER);
    match tokio::time::timeout(within, limited.collect()).await {
        Err(_) => Err(ProxyError::PrefillAnswer(format!(
            "not read whole within {} ms",
            within.as_millis()
        ))),
        Ok(Err(e)) => Err(ProxyError::PrefillAnswer(crate::http::error_chain(&*e))),
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
    }
}

/// Counts a request whose client left during its prefill leg, unless disarmed first.
struct Abandoned(Option<std::sync::Arc<crate::metrics::PdCounts>>);

impl Abandoned {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for Abandoned {
    fn drop(&mut self) {
        if let Some(pd) = self.0.take() {
            pd.abandoned();
        }
    }
}
