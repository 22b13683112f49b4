//! Tokenizing the prompt for exact prefix-cache routing (`routing.kv_events` with a model's
//! tokenizer in `[[models]]`): a body kept whole is tokenized off the runtime's threads
//! (`spawn_blocking`: a fresh 8k-token prompt takes milliseconds) and its token ids ride on
//! the request to `pick`, which names its blocks the way the ranks' indexes do. Any other
//! request passes straight through, with no allocation.

use std::sync::Arc;

use http::Request;

use super::layer::{Below, Step};
use crate::prompt::{PromptTokens, Prompts};
use crate::upstream::RequestBody;

#[derive(Clone)]
pub struct Tokens<S> {
    inner: S,
    /// `None`: off (no `routing.kv_events`, or no model has a tokenizer).
    prompts: Option<Arc<Prompts>>,
}

impl<S> Tokens<S> {
    pub fn new(inner: S, prompts: &Option<Arc<Prompts>>) -> Tokens<S> {
        Tokens {
            inner,
            prompts: prompts.clone(),
        }
    }
}

impl<S> tower::Service<Request<RequestBody>> for Tokens<S>
where
    S: Below<RequestBody> + Clone + Send + 'static,
{
    layer_types!(Step<S::Future>);

    fn call(&mut self, req: Request<RequestBody>) -> Self::Future {
        let (Some(prompts), RequestBody::Full(body)) = (&self.prompts, req.body()) else {
            return Step::Below(self.inner.call(req));
        };
        let (prompts, body, mut inner) = (prompts.clone(), body.clone(), self.inner.clone());
        Step::Own(Box::pin(async move {
            let mut req = req;
            // A tokenizer that panics (it is someone else's code) costs only the exact match.
            if let Ok(Some(ids)) = tokio::task::spawn_blocking(move || prompts.tokens(&body)).await
            {
                req.extensions_mut().insert(PromptTokens(Arc::new(ids)));
            }
            inner.call(req).await
        }))
    }
}
