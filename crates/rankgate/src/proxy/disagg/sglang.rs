//! SGLang's disaggregation: the same request goes to a prefill rank and a decode rank at once,
//! both carrying the prefill server's bootstrap address and the request's room; the decode
//! server fetches the room's KV from that prefill server, and its answer is the client's.
//!
//! The decode server finds the prefill rank from the room (`room % dp_size`), so the room is
//! chosen after the prefill rank is: `pick` chooses the rank by load, then the leg's hook
//! ([`LegHook`]) writes a room that lands on it into both bodies, and only then is the decode
//! leg sent. A prefill leg is therefore never failed over to another rank (the decode is
//! already waiting on its room): a prefill that fails before the decode answered fails the
//! request, and the decode leg is cancelled with it.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use rand::Rng;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::body;
use super::health::{leg_failed, leg_ok};
use super::legs::{answered, count_leg, failure, judged, Head, Split};
use super::watch::{attempts_of, stamp, Watch};
use crate::metrics::{PdFailure, PdLeg, PdStage};
use crate::policy::Leg;
use crate::proxy::error::ProxyError;
use crate::proxy::layer::{Answer, Below};
use crate::proxy::retry::Policy;
use crate::proxy::shared::Ctx;
use crate::proxy::target::{LegHook, PrefillLeg, RetryUntil, Target};
use crate::upstream::RequestBody;
use crate::worker::{Deployment, Flavor, Member, WorkerId};

/// Where the decode fetches the KV of this request from: the prefill rank's bootstrap address
/// and the room.
#[derive(Debug, Clone)]
struct Rendezvous {
    host: String,
    port: u16,
    room: u64,
    prefill: Arc<str>,
    /// How long the prefill server waits for the room's decode (its `kv_lease`).
    lease: Duration,
}

/// A room (a 63-bit integer, as SGLang's are) that lands on `rank` of `dp_size`.
pub fn room_for(rank: u32, dp_size: u32, rng: &mut impl Rng) -> u64 {
    let dp = u64::from(dp_size.max(1));
    let rank = u64::from(rank) % dp;
    let x = rng.random::<u64>() >> 1;
    let room = x - x % dp + rank;
    // Past 2^63 - 1 by the rank added: one period lower lands on the same rank.
    if room >= 1 << 63 {
        room - dp
    } else {
        room
    }
}

/// The bootstrap address and room for a prefill leg on `target`.
fn rendezvous(target: &Target) -> Rendezvous {
    let cfg = &target.engine.cfg;
    let origin = &target.engine.conn.origin;
    let host = origin.host().unwrap_or_default();
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let port = cfg
        .bootstrap_port
        .unwrap_or(crate::config::SGLANG_BOOTSTRAP_PORT);
    // The room is read modulo the deployment's DP size against its global ranks.
    let (rank, dp_size) = match (&cfg.deployment, target.worker.id.rank) {
        (Deployment::Own, Some(r)) => (r, cfg.dp_size),
        (Deployment::Member { .. }, Some(r)) => (
            r,
            (cfg.reported.as_ref())
                .and_then(|rep| rep.dp_size)
                .unwrap_or(cfg.start_rank + cfg.dp_size),
        ),
        (_, None) => (0, 1),
    };
    Rendezvous {
        host,
        port,
        room: room_for(rank, dp_size, &mut rand::rng()),
        prefill: target.worker.id_text.clone(),
        lease: target.engine.kv_lease(),
    }
}

/// What the prefill leg's hook keeps: the rank it wrote a room for, and the body it wrote (the
/// same body again should the leg be resent to that rank on a new connection).
type Written = Option<(WorkerId, Bytes)>;

/// One SGLang request's two legs: what every round of them needs.
pub(super) struct Legs<'a> {
    pub ctx: &'a Ctx,
    pub head: &'a Head,
    pub client: &'a Bytes,
    /// `routing.max_attempts` and the retry budget a prefill failover draws on.
    pub retry: &'a Arc<Policy>,
}

/// One round's end: the answer, and the prefill rank to fail over from when its leg failed
/// before the decode answered (the client has seen nothing).
type Round = (Answer, Option<Arc<Member>>);

impl Legs<'_> {
    /// The legs, and again on another prefill rank (with a new room and a new decode leg, the
    /// old one cancelled) while a prefill leg fails before any answer reached the client,
    /// within `routing.max_attempts` and the retry budget: the failover a vLLM prefill leg
    /// gets from the retry layer, which an SGLang one cannot (its decode waits on its room).
    pub(super) async fn serve<S>(&self, inner: S, mut split: Split, mut watch: Watch) -> Answer
    where
        S: Below<RequestBody> + Clone + Send + 'static,
    {
        let mut attempts = 1;
        let (mut answer, mut failed) = self.round(inner.clone(), &split, &mut watch).await;
        while let Some(worker) = failed.take() {
            if attempts >= self.retry.max_attempts() || !self.retry.withdraw() {
                break;
            }
            self.ctx.metrics.retried();
            split.base.worker(worker.key);
            attempts += 1;
            let (next, next_failed) = self.round(inner.clone(), &split, &mut watch).await;
            // No other prefill rank: the failure the client gets is the real one.
            if let Err(e) = &next {
                if matches!(
                    e.root(),
                    ProxyError::NoRank(_) | ProxyError::NoRankUnlisted { .. }
                ) {
                    break;
                }
            }
            (answer, failed) = (next, next_failed);
        }
        watch.done();
        stamp(answer, watch.tally)
    }

    /// A prefill leg that ended before the decode answered: counted, and whether it is worth
    /// another prefill rank (failed before its first byte: transport, 502-504).
    fn prefill_failed(&self, answer: Answer) -> Round {
        let pd = &self.ctx.metrics.pd;
        match answer {
            Ok(resp) => {
                count_leg(&resp, PdLeg::Prefill);
                let worker = resp.body().target.as_ref().map(|t| t.worker.clone());
                let status = resp.status();
                match status.is_server_error() {
                    true => leg_failed(
                        pd,
                        PdLeg::Prefill,
                        PdFailure::Status,
                        worker.as_deref(),
                        Flavor::Sglang,
                    ),
                    false => pd.failed(PdLeg::Prefill, PdFailure::Status),
                }
                let again = worker.filter(|_| matches!(status.as_u16(), 502..=504));
                (Ok(resp), again)
            }
            Err(e) => {
                let worker = e.worker().cloned();
                leg_failed(
                    pd,
                    PdLeg::Prefill,
                    failure(&e),
                    worker.as_deref(),
                    Flavor::Sglang,
                );
                let again = worker.filter(|_| e.retryable());
                (Err(e), again)
            }
        }
    }

    /// Both legs once.
    async fn round<S>(&self, mut inner: S, split: &Split, watch: &mut Watch) -> Round
    where
        S: Below<RequestBody> + Clone + Send + 'static,
    {
        let ctx = self.ctx;
        let pd = ctx.metrics.pd.clone();
        let started = Instant::now();
        let (tx, rx) = oneshot::channel::<Rendezvous>();
        let tx = Mutex::new(Some(tx));
        let written: Mutex<Written> = Mutex::new(None);
        let for_hook = self.client.clone();
        let hook = LegHook(Arc::new(move |target: &Target| {
            let mut w = written.lock().unwrap_or_else(PoisonError::into_inner);
            match &*w {
                Some((key, body)) if *key == target.worker.key => return Ok(body.clone()),
                Some(_) => return Err(ProxyError::Internal(
                    "an SGLang prefill leg cannot move to another rank: its decode waits on the room"
                        .into(),
                )),
                None => {}
            }
            let r = rendezvous(target);
            let body = body::bootstrap(&for_hook, &r.host, r.port, r.room)?;
            *w = Some((target.worker.key, body.clone()));
            if let Some(tx) = tx.lock().unwrap_or_else(PoisonError::into_inner).take() {
                let _ = tx.send(r);
            }
            Ok(body)
        }));
        let prefill_req = self
            .head
            .leg(self.client.clone(), split.avoid(Leg::Prefill), true);
        let mut prefill_req = prefill_req;
        let ext = prefill_req.extensions_mut();
        ext.insert(hook);
        // No failover within the leg: the decode leg is sent the room of this rank (a new
        // round fails it over, with a new room).
        ext.insert(RetryUntil(started, false));
        watch.at(PdStage::Prefill);
        let mut prefill = inner.call(prefill_req);
        // The pick has chosen the prefill rank once the room is written; a prefill leg that ends
        // before that found no rank, or failed on the rank it found.
        let rendezvous = tokio::select! {
            r = rx => r.ok(),
            answer = &mut prefill => {
                watch.tally.prefill += attempts_of(&answer);
                return self.prefill_failed(answer);
            }
        };
        let Some(r) = rendezvous else {
            // The hook is gone without sending: the leg ended; its answer says why.
            let answer = prefill.await;
            watch.tally.prefill += attempts_of(&answer);
            return self.prefill_failed(answer);
        };
        // The prefill leg is sent: one attempt (never failed over within the round).
        watch.tally.prefill += 1;
        watch.prefill_worker = Some(r.prefill.clone());
        let decode_started = Instant::now();
        let decode_body = match body::bootstrap(self.client, &r.host, r.port, r.room) {
            Ok(b) => b,
            Err(e) => return (Err(e), None),
        };
        let mut decode_req = self.head.leg(decode_body, split.avoid(Leg::Decode), false);
        // Another decode rank may take the room while its prefill server waits for one.
        (decode_req.extensions_mut()).insert(RetryUntil(decode_started + r.lease, true));
        // Both legs at once from here: a client that leaves closes both connections, and SGLang
        // aborts both requests (the prefill's answer comes only once its KV went out).
        watch.at(PdStage::Decode);
        let mut decode = inner.call(decode_req);
        let mut prefill_took: Option<Duration> = None;
        let mut prefill = Some(prefill);
        // Both legs run; the decode's answer is the client's. A prefill that fails first cancels
        // the decode (dropped: its connection closes, and SGLang aborts it).
        let answer = loop {
            let Some(p) = prefill.as_mut() else {
                break (&mut decode).await;
            };
            tokio::select! {
                answer = p => {
                    prefill = None;
                    match answer {
                        Ok(resp) if resp.status().is_success() => {
                            prefill_took = Some(started.elapsed());
                            count_leg(&resp, PdLeg::Prefill);
                            if let Some(t) = &resp.body().target {
                                leg_ok(&t.worker);
                            }
                            tokio::spawn(drain(resp));
                        }
                        failed => return self.prefill_failed(failed),
                    }
                }
                answer = &mut decode => break answer,
            }
        };
        watch.tally.decode += attempts_of(&answer);
        if let Some(p) = prefill.take() {
            // The decode answered first: the prefill's answer is only read out, in the
            // background.
            tokio::spawn(async move {
                match p.await {
                    Ok(resp) => {
                        pd.prefill_took(started.elapsed());
                        count_leg(&resp, PdLeg::Prefill);
                        drain(resp).await
                    }
                    Err(e) => pd.failed(PdLeg::Prefill, failure(&e)),
                }
            });
        }
        if let Some(took) = prefill_took {
            ctx.metrics.pd.prefill_took(took);
        }
        let leg = PrefillLeg {
            worker: r.prefill.clone(),
            // Concurrent legs: the prefill's answer time when it came first, else the time the
            // decode took to answer (the prefill was still going).
            took: prefill_took.unwrap_or_else(|| started.elapsed()),
            decode_started,
            kv_from: Some(format!("{}:{} room {}", r.host, r.port, r.room).into()),
            prefill_attempts: 0,
            decode_attempts: 0,
            decode_failed: false,
        };
        let answer = answered(ctx, answer, leg.clone(), Flavor::Sglang);
        match judged(answer, leg).await {
            Ok(answer) => (answer, None),
            Err(failed) => (failed.into_answer(watch.tally), None),
        }
    }
}

/// Reads a prefill answer to its end and drops it (so its rank's guards end with it).
async fn drain(resp: http::Response<crate::proxy::body::ProxyBody>) {
    let mut body = resp.into_body();
    while let Some(Ok(_)) = body.frame().await {}
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// A room always lands on the rank it was chosen for, and is a 63-bit integer.
        #[test]
        fn a_room_lands_on_its_rank(rank in 0u32..64, dp in 1u32..64, seed in proptest::num::u64::ANY) {
            let rank = rank % dp;
            let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
            let room = room_for(rank, dp, &mut rng);
            proptest::prop_assert_eq!(room % u64::from(dp), u64::from(rank));
            proptest::prop_assert!(room < 1 << 63);
        }
    }
}
