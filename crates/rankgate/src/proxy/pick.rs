//! Picking the rank and pinning the request to it.
//!
//! The pick is the selector's (one snapshot load, never a rank with unknown telemetry while one
//! has numbers, never an ejected rank, never one a retry avoids). Pinning: vLLM takes the rank in
//! the `X-data-parallel-rank` header and its body passes untouched; SGLang gets the body field
//! too, so its body is read whole first. A client's own pin never reaches the engine.

use http::header::{self, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Uri, Version};

use super::error::ProxyError;
use super::layer::{content_length, Below, Step, RANK_HEADER};
use super::pin::pin_in_body;
use super::shared::Ctx;
use super::target::{LegHook, Picked, Target};
use super::trace::{self, Traced};
use super::{grpc, read, route};
use crate::policy::{Avoid, Explanation, Leg};
use crate::prompt::{Prompt, PromptTokens};
use crate::upstream::RequestBody;
use crate::worker::Flavor;

#[derive(Clone)]
pub struct Pick<S> {
    inner: S,
    ctx: Ctx,
    /// `server.max_body_bytes`, for a body read whole here to pin the rank inside it.
    max_body: usize,
}

impl<S> Pick<S> {
    pub fn new(inner: S, ctx: &Ctx, max_body: usize) -> Pick<S> {
        Pick {
            inner,
            ctx: ctx.clone(),
            max_body,
        }
    }
}

impl<S> tower::Service<Request<RequestBody>> for Pick<S>
where
    S: Below<Picked> + Clone + Send + 'static,
{
    layer_types!(Step<S::Future>);

    fn call(&mut self, mut req: Request<RequestBody>) -> Self::Future {
        let shared = &*self.ctx;
        let length = match req.body() {
            RequestBody::Full(b) => Some(b.len() as u64),
            RequestBody::Stream(_) => content_length(req.headers()),
        };
        let avoid = req.extensions_mut().remove::<Avoid>().unwrap_or_default();
        // A traced request's pick is explained (see `trace`); the usual one's is not.
        let traced = req.extensions().get::<Traced>().cloned();
        let mut explained = traced.as_ref().map(|_| Explanation::default());
        // Affinity reads the prompt from a body kept whole (one too large to keep is routed
        // by load alone).
        // A decode leg is sent its prompt's KV by its prefill rank: where the prompt was sent
        // before does not matter there.
        let affinity = shared.selector.affinity() && avoid.leg != Leg::Decode;
        let prompt = match (affinity, req.body()) {
            (true, RequestBody::Full(b)) => Prompt {
                chunks: crate::prefix::prompt_chunks(b),
                tokens: req.extensions().get::<PromptTokens>().map(|t| t.0.clone()),
            },
            _ => Prompt::default(),
        };
        let (table, x) = (&shared.table, explained.as_mut());
        let result = (shared.selector).pick_explained(table, length, &avoid, &prompt, x);
        if let Some(x) = explained.as_mut().filter(|x| x.prompt_tokens.is_none()) {
            // Tokenized but not weighed (a decode leg): the explanation still counts them.
            x.prompt_tokens = req.extensions().get::<PromptTokens>().map(|t| t.0.len());
        }
        let picked = match result {
            Ok(p) => p,
            Err(e) => {
                if let (Some(t), Some(x)) = (&traced, &explained) {
                    t.picked(x, None);
                }
                return Step::ready(Err(match avoid.unlisted_model {
                    Some(model) => ProxyError::NoRankUnlisted { model, why: e },
                    None => e.into(),
                }));
            }
        };
        if picked.skipped_unavailable {
            shared.metrics.skipped_unavailable();
        }
        let worker = picked.guard.member().clone();
        let w = &worker;
        let target = Target {
            worker: worker.clone(),
            engine: picked.engine,
            trial: picked.trial,
        };
        let engine = &target.engine;
        let attempt = (traced.as_ref().zip(explained.as_ref()))
            .and_then(|(t, x)| t.picked(x, Some((w, engine, target.trial))));

        // The hop-by-hop headers are gone already: `identity` removed them before writing
        // its own, so that no client can have those removed.
        let (mut parts, body) = req.into_parts();
        #[cfg(feature = "otlp")]
        if let Some(v) = attempt.as_ref().and_then(crate::otlp::traceparent) {
            // The engine's spans are children of this attempt's.
            parts.headers.insert(crate::tracecontext::TRACEPARENT, v);
        }
        // The client's own pin never reaches the engine: rankgate decides the rank (`insert`
        // replaces every value the client sent).
        let grpc = self.ctx.grpc();
        match (&worker.pin_header, grpc) {
            (Some(pin), false) => {
                parts.headers.insert(RANK_HEADER, pin.clone());
            }
            _ => {
                parts.headers.remove(&RANK_HEADER);
            }
        }
        // An engine with a key of its own gets that key, never the client's.
        if let Some(key) = &engine.api_key {
            parts.headers.insert(header::AUTHORIZATION, key.0.clone());
        }
        let uri = if grpc {
            // gRPC servers insist on it (it says the client understands trailers).
            parts
                .headers
                .insert(header::TE, HeaderValue::from_static("trailers"));
            // h2 carries the engine's authority in `:authority`; the client's Host names rankgate.
            parts.headers.remove(header::HOST);
            parts.version = Version::HTTP_2;
            let mut uri = http::uri::Parts::default();
            uri.scheme = Some(engine.conn.scheme.clone());
            uri.authority = engine.conn.grpc_authority.clone();
            uri.path_and_query = Some(path_and_query(&parts.uri));
            Some(uri)
        } else {
            parts.version = Version::HTTP_11;
            // The engine's own Host, never the client's (which names rankgate).
            parts.headers.insert(header::HOST, engine.conn.host.clone());
            // HTTP/1 goes out on the engine's own connection in origin form (`/path?query`),
            // as most clients send it; an absolute-form target is cut down to that.
            (parts.uri.scheme().is_some() || parts.uri.authority().is_some()).then(|| {
                let mut uri = http::uri::Parts::default();
                uri.path_and_query = Some(path_and_query(&parts.uri));
                uri
            })
        };
        if let Some(uri) = uri {
            parts.uri = match Uri::from_parts(uri) {
                Ok(u) => u,
                Err(err) => {
                    return Step::ready(Err(
                        ProxyError::Internal(format!("building URI: {err}")).at(w)
                    ))
                }
            };
        }
        let body_pin = match grpc {
            true => grpc::rank_field(parts.uri.path())
                .zip(worker.pin_rank)
                .map(|(field, rank)| BodyPin::Grpc(field, rank)),
            false => (engine.flavor == Flavor::Sglang
                && route::table(parts.uri.path()).is_some_and(|(_, r)| r.sglang_body_pin))
            .then_some(worker.pin_rank)
            .flatten()
            .map(BodyPin::Json),
        };
        // A leg whose body depends on its rank (an SGLang prefill leg's room) is written now.
        let body = match parts.extensions.remove::<LegHook>() {
            None => body,
            Some(hook) => match (hook.0)(&target) {
                Ok(written) => {
                    (parts.headers)
                        .insert(header::CONTENT_LENGTH, HeaderValue::from(written.len()));
                    RequestBody::Full(written)
                }
                Err(err) => return Step::ready(Err(err.at(w))),
            },
        };
        let guard = picked.guard;
        // The usual case goes straight on: no future of this layer's own. What follows the
        // response (the guard in its body, the worker header) is done by `send`, which holds
        // both once the request is `Picked`.
        let body = match (body_pin, body) {
            (None, body) => body,
            (Some(pin), RequestBody::Full(whole)) => match pin.apply(&whole) {
                Ok(pinned) => {
                    parts
                        .headers
                        .insert(header::CONTENT_LENGTH, HeaderValue::from(pinned.len()));
                    RequestBody::Full(pinned)
                }
                Err(err) => return Step::ready(Err(err.at(w))),
            },
            (Some(pin), streamed) => {
                // An SGLang body too large to have been read whole yet: read the rest first.
                let max = self.max_body;
                let mut inner = self.inner.clone();
                return in_span(
                    attempt,
                    Step::Own(Box::pin(async move {
                        let whole = read::whole(streamed, max)
                            .await
                            .map_err(|err| err.at(&worker))?;
                        let pinned = pin.apply(&whole).map_err(|err| err.at(&worker))?;
                        parts
                            .headers
                            .insert(header::CONTENT_LENGTH, HeaderValue::from(pinned.len()));
                        let body = RequestBody::Full(pinned);
                        let picked = Picked {
                            target,
                            body,
                            guard,
                        };
                        inner.call(Request::from_parts(parts, picked)).await
                    })),
                );
            }
        };
        let picked = Picked {
            target,
            body,
            guard,
        };
        in_span(
            attempt,
            Step::Below(self.inner.call(Request::from_parts(parts, picked))),
        )
    }
}

/// The attempt, inside its span when the request is traced.
fn in_span<F>(span: Option<tracing::Span>, step: Step<F>) -> Step<F>
where
    F: std::future::Future<Output = super::layer::Answer> + Send + Unpin + 'static,
{
    match span {
        Some(span) => Step::Own(Box::pin(trace::attempt(span, step))),
        None => step,
    }
}

/// Where a rank goes inside a request body.
#[derive(Debug, Clone, Copy)]
enum BodyPin {
    /// SGLang's JSON `data_parallel_rank`.
    Json(u32),
    /// A gRPC request message's rank field (number, rank).
    Grpc(u64, u32),
}

impl BodyPin {
    fn apply(self, whole: &bytes::Bytes) -> Result<bytes::Bytes, ProxyError> {
        match self {
            BodyPin::Json(rank) => pin_in_body(whole, rank),
            BodyPin::Grpc(field, rank) => grpc::pin(whole, field, rank),
        }
    }
}

/// The path and query of `uri` (`/` when it has none: `OPTIONS *` or an authority alone).
fn path_and_query(uri: &Uri) -> PathAndQuery {
    uri.path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"))
}
