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
//! prefill, within the retry budget, only where a decode rank it did not fail on can take it.
//! A decode leg that failed is the client's answer as the decode's failure
//! ([`ProxyError::Decode`]), never a later round's "no rank". A client that leaves during the
//! prefill leg never gets a decode leg; one that leaves between the legs has the prefill's
//! blocks released (`release`); every abandoned request is counted by stage and logged
//! (`watch`), and the access line counts each leg's attempts. How each leg ended is counted and
//! judged in `health`.
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
mod release;
mod sglang;
mod watch;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use tokio::time::Instant;

use super::error::ProxyError;
use super::layer::{Answer, Below, Step};
use super::read;
use super::retry::Policy;
use super::shared::Ctx;
use super::target::{PrefillLeg, RetryUntil};
use crate::metrics::{PdFailure, PdLeg, PdStage};
use crate::policy::Leg;
use crate::upstream::RequestBody;
use crate::worker::Flavor;
use health::{leg_failed, leg_ok};
pub use legs::Split;
use legs::{answered, count_leg, failure, judged, Failed, Head};
use release::{Lent, Release};
use watch::Watch;

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
    /// `server.access_log`: a request whose client left is logged here.
    access_log: bool,
}

impl<S> Disagg<S> {
    pub fn new(
        inner: S,
        ctx: &Ctx,
        max_body: usize,
        answer_within: Duration,
        retry: &Arc<Policy>,
        access_log: bool,
    ) -> Disagg<S> {
        Disagg {
            inner,
            ctx: ctx.clone(),
            max_body,
            answer_within,
            retry: retry.clone(),
            access_log,
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
        let watch = Watch::new(&self.ctx.metrics.pd, &parts, &client, self.access_log);
        let head = Head(parts);
        match split.flavor {
            Flavor::Sglang => {
                let legs = sglang::Legs {
                    ctx: &self.ctx,
                    head: &head,
                    client: &client,
                    retry: &self.retry,
                };
                legs.serve(self.inner.clone(), split, watch).await
            }
            _ => self.vllm(head, client, split, watch).await,
        }
    }

    /// vLLM's two legs, one after the other. A decode leg that failed on every decode rank the
    /// retry layer could fail it over to (with the same blocks, within the prefill server's
    /// lease) runs once more from a new prefill, within the retry budget, only where a decode
    /// rank it did not fail on is there to take it: with none, a second prefill would only
    /// pin blocks no decode pulls. The client gets the decode's failure, never the second
    /// round's "no rank".
    async fn vllm(
        mut self,
        head: Head,
        client: Bytes,
        mut split: Split,
        mut watch: Watch,
    ) -> Answer {
        let failed = match self.two_legs(&head, &client, &split, &mut watch).await {
            Round::Prefill(answer) => return self.ended(answer, watch),
            Round::Decode(Ok(answer)) => return self.ended(answer, watch),
            Round::Decode(Err(failed)) => failed,
        };
        if !failed.worth_a_new_prefill() || !self.another_decode(&failed, &mut split) {
            watch.done();
            return failed.into_answer(watch.tally);
        }
        if !self.retry.withdraw() {
            self.ctx.metrics.retry_refused();
            watch.done();
            return failed.into_answer(watch.tally);
        }
        self.ctx.metrics.retried();
        match self.two_legs(&head, &client, &split, &mut watch).await {
            Round::Decode(Ok(answer)) => self.ended(answer, watch),
            // No decode rank after all (gone since), or the second prefill found none: the
            // failure the client gets is the real one.
            Round::Decode(Err(again)) if again.no_rank() => {
                watch.done();
                failed.into_answer(watch.tally)
            }
            Round::Prefill(Err(e))
                if matches!(
                    e.root(),
                    ProxyError::NoRank(_) | ProxyError::NoRankUnlisted { .. }
                ) =>
            {
                watch.done();
                failed.into_answer(watch.tally)
            }
            Round::Decode(Err(again)) => {
                watch.done();
                again.into_answer(watch.tally)
            }
            Round::Prefill(answer) => self.ended(answer, watch),
        }
    }

    /// The client's answer, with every attempt of both legs on it.
    fn ended(&self, answer: Answer, mut watch: Watch) -> Answer {
        watch.done();
        watch::stamp(answer, watch.tally)
    }

    /// Whether a decode rank other than the one `failed` on could take the request now; if so,
    /// that one is avoided from here on.
    fn another_decode(&self, failed: &Failed, split: &mut Split) -> bool {
        let Some(w) = &failed.worker else {
            return false;
        };
        let mut avoid = split.avoid(Leg::Decode);
        avoid.worker(w.key);
        if !self.ctx.selector.any_routable(&self.ctx.table, &avoid) {
            return false;
        }
        split.base.worker(w.key);
        true
    }

    /// The two legs once.
    async fn two_legs(
        &mut self,
        head: &Head,
        client: &Bytes,
        split: &Split,
        watch: &mut Watch,
    ) -> Round {
        let pd = self.ctx.metrics.pd.clone();
        let started = Instant::now();
        watch.at(PdStage::Prefill);
        let prefill_req = match body::prefill(client) {
            Ok(b) => head.leg(b, split.avoid(Leg::Prefill), true),
            Err(e) => return Round::Prefill(Err(e)),
        };
        // Dropped with this future if the client leaves during the prefill leg: counted
        // (`watch`), and no decode leg is started.
        let answer = self.inner.call(prefill_req).await;
        watch.tally.prefill += watch::attempts_of(&answer);
        let resp = match answer {
            Ok(resp) => resp,
            Err(e) => {
                let at = e.worker().cloned();
                leg_failed(
                    &pd,
                    PdLeg::Prefill,
                    failure(&e),
                    at.as_deref(),
                    Flavor::Vllm,
                );
                return Round::Prefill(Err(e));
            }
        };
        let Some(prefill) = resp.body().target.clone() else {
            return Round::Prefill(Err(ProxyError::Internal(
                "a prefill answer without its rank".into(),
            )));
        };
        count_leg(&resp, PdLeg::Prefill);
        if !resp.status().is_success() {
            // The engine's own error (a 4xx is the client's request refused): the client
            // reads it as the engine wrote it. 5xx were failed over below already.
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
            return Round::Prefill(Ok(resp));
        }
        // From here the prefill server holds the blocks for a decode.
        watch.at(PdStage::Between);
        watch.prefill_worker = Some(prefill.worker.id_text.clone());
        let lease = prefill.engine.kv_lease();
        // Should the client leave before the decode leg goes out, the blocks are released.
        let mut lent = Lent::new(
            resp.into_body(),
            Release {
                inner: self.inner.clone(),
                ctx: self.ctx.clone(),
                method: head.0.method.clone(),
                uri: head.0.uri.clone(),
                headers: head.0.headers.clone(),
                client: client.clone(),
                avoid: split.avoid(Leg::Decode),
                within: self.answer_within,
                lease,
                engine: prefill.engine.clone(),
            },
        );
        let params = (lent.answer(self.answer_within).await)
            .and_then(|answer| body::params(&answer).map(Bytes::copy_from_slice));
        // Untrusted: checked before any decode sees them (a refusal is `bad_params`).
        let params = kv_params::checked(params, &prefill.engine).await;
        let params = match params {
            Ok(p) => p,
            Err(e) => {
                lent.handed_on();
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
                return Round::Prefill(Err(e.at(&prefill.worker)));
            }
        };
        lent.read(params.clone());
        leg_ok(&prefill.worker);
        let prefill_took = started.elapsed();
        pd.prefill_took(prefill_took);
        let decode_started = Instant::now();
        let mut decode_req = match body::decode(client, &params) {
            Ok(b) => head.leg(b, split.avoid(Leg::Decode), false),
            Err(e) => return Round::Prefill(Err(e)),
        };
        // Another decode rank may pull the same blocks while the prefill server keeps them.
        (decode_req.extensions_mut()).insert(RetryUntil(decode_started + lease, true));
        let leg = PrefillLeg {
            worker: prefill.worker.id_text.clone(),
            took: prefill_took,
            decode_started,
            kv_from: body::kv_source(&params),
            prefill_attempts: 0,
            decode_attempts: 0,
            decode_failed: false,
        };
        // A client that leaves now closes the decode's connection: vLLM aborts the request,
        // and a decode aborted before it pulled tells the prefill server to free the blocks.
        watch.at(PdStage::Decode);
        lent.handed_on();
        drop(lent);
        let answer = self.inner.call(decode_req).await;
        watch.tally.decode += watch::attempts_of(&answer);
        let answer = answered(&self.ctx, answer, leg.clone(), Flavor::Vllm);
        Round::Decode(judged(answer, leg).await)
    }
}

/// One round of the legs: the prefill leg's answer when no decode leg followed, else the
/// decode leg's (the client's answer, or how it failed).
enum Round {
    Prefill(Answer),
    Decode(Result<Answer, Failed>),
}
