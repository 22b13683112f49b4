//! What a response body holds until it ends, one guard per layer that needs one: the admission
//! (admit), the engine connection slot (send), the outlier verdict on a stream (observe), and
//! the request's time to first byte, duration and access log line (respond). A guard gives back
//! or records what it holds when dropped, however the body ends.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body::Frame;
use tokio::time::Instant;

use super::shared::Ctx;
use super::target::Target;
use crate::metrics::{Metrics, ModelIdx};
use crate::outlier::{Cause, Policy};
use crate::upstream::Sender;
use crate::worker::EngineEntry;

/// The requests admitted now, under `server.max_in_flight` (admit).
#[derive(Debug)]
pub struct Admission {
    pub limit: usize,
    pub count: AtomicUsize,
}

impl Admission {
    pub fn new(limit: usize) -> Admission {
        Admission {
            limit,
            count: AtomicUsize::new(0),
        }
    }
}

/// One admitted request, counted until its response body ends.
#[derive(Debug)]
pub struct Admitted(pub(super) Arc<Admission>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Relaxed);
    }
}

/// One request counted against its client address's `server.max_streams_per_client` until
/// its response body ends (taken by `respond`). Holds the connection's handle (whose reference
/// count stays on its core); the count itself is one table for the router.
#[derive(Debug)]
pub struct ClientStream(Ctx);

impl ClientStream {
    pub(super) fn new(ctx: &Ctx) -> ClientStream {
        ClientStream(ctx.clone())
    }
}

impl Drop for ClientStream {
    fn drop(&mut self) {
        if let Some(key) = self.0.conn().client {
            self.0.clients.give_back(key);
        }
    }
}

/// Records one request's time to first byte when the engine's first chunk passes, and its
/// duration when its response body ends or is dropped.
#[derive(Debug)]
pub struct Done {
    started: Instant,
    pub ctx: super::shared::Ctx,
    pub model: ModelIdx,
    /// The first chunk was seen: one observation per request, however many chunks follow.
    first_seen: bool,
    /// The access log line, when `server.access_log` is on.
    pub access: Option<Box<Access>>,
    /// A disaggregated request's prefill leg: logged with the decode's line, and the decode
    /// leg's first byte timed from its own start.
    pub prefill: Option<Box<super::target::PrefillLeg>>,
}

/// What the access log line says of a request: gathered on its way through `respond`, finished
/// when its body ends (or is dropped: a client that left is logged too).
#[derive(Debug)]
pub struct Access {
    pub method: http::Method,
    pub path: String,
    pub request_id: Option<http::HeaderValue>,
    pub status: u16,
    pub worker: Option<std::sync::Arc<str>>,
    /// Attempts on engines (retries included); 0 for rankgate's own answers.
    pub attempts: u32,
    pub bytes: u64,
    pub ttfb: Option<Duration>,
}

impl Done {
    pub fn new(started: Instant, ctx: &super::shared::Ctx, model: ModelIdx) -> Done {
        Done {
            started,
            ctx: ctx.clone(),
            model,
            first_seen: false,
            access: None,
            prefill: None,
        }
    }

    /// A frame of the engine's body went to the client.
    #[inline]
    pub(super) fn passed(&mut self, frame: &Frame<Bytes>) {
        let len = frame.data_ref().map_or(0, |d| d.len());
        if !self.first_seen && len > 0 {
            self.first_seen = true;
            let since = self.started.elapsed();
            (self.ctx.metrics).first_byte(self.model, since);
            if let Some(p) = self.prefill.as_ref().filter(|p| !p.decode_failed) {
                (self.ctx.metrics.pd).decode_first_byte(p.decode_started.elapsed());
            }
            if let Some(a) = &mut self.access {
                a.ttfb = Some(since);
            }
        }
        if let Some(a) = &mut self.access {
            a.bytes += len as u64;
        }
    }
}

impl Drop for Done {
    fn drop(&mut self) {
        let took = self.started.elapsed();
        (self.ctx.metrics).finished(self.model, took);
        if let Some(a) = self.access.take() {
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            tracing::info!(
                target: "rankgate::access",
                method = %a.method,
                path = %a.path,
                model = self.ctx.metrics.model_name(self.model),
                worker = a.worker.as_deref().unwrap_or("-"),
                status = a.status,
                bytes = a.bytes,
                duration_ms = ms(took),
                ttfb_ms = a.ttfb.map(ms),
                request_id = a.request_id.as_ref().and_then(|v| v.to_str().ok()).unwrap_or("-"),
                attempts = a.attempts,
                prefill_worker = self.prefill.as_ref().map(|p| &*p.worker),
                prefill_ms = self.prefill.as_ref().map(|p| ms(p.took)),
                prefill_attempts = self.prefill.as_ref().map(|p| p.prefill_attempts),
                decode_attempts = self.prefill.as_ref().map(|p| p.decode_attempts),
                kv_from = self.prefill.as_ref().and_then(|p| p.kv_from.as_deref()),
                cut = crate::http::send_timed_out().then_some("send_timeout"),
                "request"
            );
        }
    }
}

/// One taken connection slot (HTTP/1) or stream on a connection (gRPC), given back when
/// dropped (with the response body).
#[derive(Debug)]
pub struct Slot {
    engine: Arc<EngineEntry>,
    /// The gRPC connection the call is a stream on.
    stream: Option<usize>,
    /// The HTTP/1 connection the request went out on, and the core whose idle list it goes
    /// back to once the response has ended cleanly ([`Slot::ended`]).
    pub(super) sender: Option<Sender>,
    core: usize,
    /// The client's key, whose share of the engine's slots this one counts in (`None`: a
    /// trusted proxy's, held to no share).
    client: Option<u32>,
    ended: bool,
}

impl Slot {
    /// A slot for a request of the client connection `conn` (its core, its address's share).
    pub(super) fn connection(engine: &Arc<EngineEntry>, conn: &super::shared::Conn) -> Slot {
        Slot {
            engine: engine.clone(),
            stream: None,
            sender: None,
            core: conn.core,
            client: conn.client,
            ended: false,
        }
    }

    pub(super) fn stream(engine: &Arc<EngineEntry>, k: usize) -> Slot {
        Slot {
            engine: engine.clone(),
            stream: Some(k),
            sender: None,
            core: 0,
            client: None,
            ended: false,
        }
    }

    /// The response body was read to its end: the connection may carry another request.
    pub fn ended(&mut self) {
        self.ended = true;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        match self.stream {
            Some(k) => self.engine.conn.streams.give_back(k),
            None => {
                if let Some(sender) = self.sender.take().filter(|_| self.ended) {
                    self.engine.conn.idle.give_back(self.core, sender);
                }
                self.engine.conn.slots.give_back(self.client)
            }
        }
    }
}

/// Records a failure of `cause` on worker `w` (on all of its engine's ranks for the transport).
pub(super) fn failure(metrics: &Metrics, policy: Policy, target: &Target, cause: Cause) {
    let ranks = match cause {
        Cause::Transport => &target.engine.members[..],
        Cause::Status(_) | Cause::Timeout | Cause::Hung | Cause::Mixed => {
            std::slice::from_ref(&target.worker)
        }
    };
    for w in ranks {
        if let Some(e) = w.live.outlier.failure(cause, policy) {
            metrics.ejected(w);
            tracing::warn!(worker = %w.id_text, reason = %e, "rank ejected");
        }
    }
}

/// The verdict on a response whose headers were fine: success once its body ends cleanly, a
/// failure if it breaks after its headers went out (against its engine, or its rank when the
/// engine just went quiet). Judging at the headers would let every new stream of a rank that
/// stalls mid-way wipe the failure the previous stall counted, so it would never be ejected (and
/// a trial would re-admit it on headers alone). A body dropped unfinished (the client left) is no
/// verdict (a trial passes to the next request), only counted as abandoned mid-stream.
#[derive(Debug)]
pub struct BreakWatch {
    ctx: Ctx,
    policy: Policy,
    target: Target,
    judged: bool,
}

impl BreakWatch {
    pub(super) fn new(ctx: &Ctx, policy: Policy, target: Target) -> BreakWatch {
        BreakWatch {
            ctx: ctx.clone(),
            policy,
            target,
            judged: false,
        }
    }

    pub fn fire(mut self, idle: bool) {
        self.judged = true;
        let cause = if idle {
            Cause::Timeout
        } else {
            Cause::Transport
        };
        failure(&self.ctx.metrics, self.policy, &self.target, cause);
    }

    /// The body ended cleanly.
    pub fn ended(mut self) {
        self.judged = true;
        success(&self.target);
    }

    /// rankgate's own shutdown cut the stream: no verdict on the engine, and no client left.
    pub fn shutdown(mut self) {
        self.judged = true;
        if self.target.trial {
            self.target.worker.live.outlier.abandon_trial();
        }
    }

    /// The stream ended with a failure status after its first byte (a gRPC call's trailers
    /// saying UNAVAILABLE): a failure of the rank, not of the whole engine's transport.
    pub fn failed(mut self, status: u16) {
        self.judged = true;
        failure(
            &self.ctx.metrics,
            self.policy,
            &self.target,
            Cause::Status(status),
        );
    }
}

impl Drop for BreakWatch {
    fn drop(&mut self) {
        if self.judged {
            return;
        }
        // Dropped unjudged: the response body went before its end, so the client left, or took
        // nothing of it for server.send_timeout and its connection was cut (no verdict on the
        // engine either way).
        if crate::http::send_timed_out() {
            self.ctx.metrics.stream_cut_send_timeout();
        } else {
            self.ctx.metrics.abandoned(&self.target.worker, true);
        }
        if self.target.trial {
            self.target.worker.live.outlier.abandon_trial();
        }
    }
}

pub(super) fn success(target: &Target) {
    if target.worker.live.outlier.success() {
        tracing::info!(worker = %target.worker.id_text, "rank re-admitted after a successful trial");
    }
}
