//! The `track` layer: a proxied call's request id is entered in [`Requests`] with the engine it
//! was picked for, and its entry rides in the response body until the call ends, so that an
//! `Abort` reaches the engine generating the request.

use std::sync::Arc;

use http::Request;

use super::calls::{one_message, request_id};
use super::requests::Requests;
use crate::proxy::layer::{Below, Step};
use crate::proxy::target::Picked;
use crate::upstream::RequestBody;

#[derive(Clone)]
pub struct Track<S> {
    inner: S,
    requests: Arc<Requests>,
}

impl<S> Track<S> {
    pub fn new(inner: S, requests: &Arc<Requests>) -> Track<S> {
        Track {
            inner,
            requests: requests.clone(),
        }
    }
}

impl<S> tower::Service<Request<Picked>> for Track<S>
where
    S: Below<Picked>,
{
    layer_types!(Step<S::Future>);

    fn call(&mut self, req: Request<Picked>) -> Self::Future {
        let picked = req.body();
        let id = match &picked.body {
            RequestBody::Full(b) => one_message(b)
                .ok()
                .and_then(|m| request_id(req.uri().path(), m)),
            RequestBody::Stream(_) => None,
        };
        let Some(id) = id else {
            return Step::Below(self.inner.call(req));
        };
        let held = self.requests.enter(id, &picked.target.engine);
        let fut = self.inner.call(req);
        Step::Own(Box::pin(async move {
            let mut resp = fut.await?;
            resp.body_mut().holds.request_id = Some(held);
            Ok(resp)
        }))
    }
}
