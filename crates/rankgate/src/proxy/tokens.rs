//! Tokenizing the prompt for exact prefix-cache routing (`routing.kv_events` with a model's
//! tokenizer in `[[models]]`): a body kept whole is tokenized off the runtime's threads
//! (`spawn_blocking`: a fresh 8k-token prompt takes milliseconds), or, for a model configured
//! with `engine_tokenize` and no tokenizer, by an engine serving it (`POST /tokenize`, its
//! time counted on `/metrics`). The token ids ride on the request to `pick`, which names its
//! blocks the way the ranks' indexes do. A failure costs only the exact match: the request
//! routes by rankgate's record. Any other request passes straight through, with no
//! allocation. So does one while no rank's index can be asked (no engine has published yet),
//! unless it asked for its pick explanation (`x-rankgate-debug`), whose `prompt_tokens` then
//! still says what the prompt counts.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;

use super::layer::{Below, Step};
use super::shared::Ctx;
use super::trace::Traced;
use crate::prompt::{PromptTokens, Prompts, Tokenizer};
use crate::tokenize::{engine_tokenize, TokenizeRequest};
use crate::upstream::RequestBody;

/// Longest wait for an engine's `/tokenize`: the request waits for it before its pick.
const ENGINE_TOKENIZE_TIMEOUT: Duration = Duration::from_secs(2);

/// The prompts' tokenizers, the client that asks engines, and how many prompts are tokenized
/// at once: one per core. A request that finds them all busy is not tokenized (it routes by
/// the record) rather than queue, so a flood of long prompts cannot fill the blocking pool or
/// delay picks.
pub struct State {
    pub prompts: Prompts,
    pub client: crate::http::HttpClient<Full<Bytes>>,
    pub permits: Arc<tokio::sync::Semaphore>,
}

impl State {
    pub fn new(prompts: Prompts, client: crate::http::HttpClient<Full<Bytes>>) -> State {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        State {
            prompts,
            client,
            permits: Arc::new(tokio::sync::Semaphore::new(cores)),
        }
    }
}

#[derive(Clone)]
pub struct Tokens<S> {
    inner: S,
    ctx: Ctx,
    /// `None`: off (no `routing.kv_events`, or no model's prompts can be tokenized).
    state: Option<Arc<State>>,
}

impl<S> Tokens<S> {
    pub fn new(inner: S, ctx: &Ctx, state: &Option<Arc<State>>) -> Tokens<S> {
        Tokens {
            inner,
            ctx: ctx.clone(),
            state: state.clone(),
        }
    }
}

impl<S> tower::Service<Request<RequestBody>> for Tokens<S>
where
    S: Below<RequestBody> + Clone + Send + 'static,
{
    layer_types!(Step<S::Future>);

    fn call(&mut self, req: Request<RequestBody>) -> Self::Future {
        let (Some(state), RequestBody::Full(body)) = (&self.state, req.body()) else {
            return Step::Below(self.inner.call(req));
        };
        let how = state.prompts.tokenizer(body);
        // Tokens only help where some rank's index can be asked now (its engine publishes,
        // and its index is available): otherwise the record decides anyway.
        let usable = || {
            let snap = self.ctx.table.snapshot.load();
            snap.fleet
                .workers
                .iter()
                .any(|w| w.kv.block_size().is_some())
        };
        // A request that asked for its pick explanation is tokenized even so: its explanation
        // then shows the prompt's token count from the very first request, before any engine
        // has published (the pick is the same: no index can be asked yet).
        let debugged = || (req.extensions().get::<Traced>()).is_some_and(Traced::debugged);
        if how == Tokenizer::None || !(usable() || debugged()) {
            return Step::Below(self.inner.call(req));
        }
        let (state, body, ctx, mut inner) = (
            state.clone(),
            body.clone(),
            self.ctx.clone(),
            self.inner.clone(),
        );
        let chat = req.uri().path().ends_with("/chat/completions");
        Step::Own(Box::pin(async move {
            let mut req = req;
            let ids = match how {
                // A tokenizer that panics (it is someone else's code) costs only the match.
                Tokenizer::Here => match state.permits.clone().try_acquire_owned() {
                    Ok(permit) => {
                        let s = state.clone();
                        let work = move || {
                            let _permit = permit;
                            s.prompts.tokens(&body)
                        };
                        tokio::task::spawn_blocking(work).await.ok().flatten()
                    }
                    Err(_) => None,
                },
                Tokenizer::Engine(model) => by_engine(&ctx, &state, &model, chat, &body).await,
                Tokenizer::None => None,
            };
            if let Some(ids) = ids {
                req.extensions_mut().insert(PromptTokens(Arc::new(ids)));
            }
            inner.call(req).await
        }))
    }
}

/// The prompt's tokens from the first engine serving `model` that has workers.
async fn by_engine(
    ctx: &Ctx,
    state: &State,
    model: &str,
    chat: bool,
    body: &[u8],
) -> Option<Vec<u32>> {
    let url = {
        let snap = ctx.table.snapshot.load();
        let fleet = &snap.fleet;
        let found = (fleet.engines.iter_enumerated())
            .find(|(e, entry)| {
                entry.http && !entry.members.is_empty() && snap.catalog.serves(*e, model)
            })
            .map(|(_, entry)| entry.url.clone());
        found?
    };
    let kind = if chat {
        TokenizeRequest::Chat
    } else {
        TokenizeRequest::Completion
    };
    let started = std::time::Instant::now();
    let answer = engine_tokenize(&state.client, &url, kind, body, ENGINE_TOKENIZE_TIMEOUT).await;
    ctx.metrics
        .engine_tokenize(answer.is_ok(), started.elapsed());
    match answer {
        Ok(t) => Some(t.tokens),
        Err(e) => {
            tracing::debug!(error = %e, "prompt not tokenized by the engine: affinity uses the record");
            None
        }
    }
}
