//! Which engine holds each in-flight gRPC request id, so that an `Abort` reaches the engine
//! generating the request (another engine would answer OK and abort nothing).
//!
//! An id is entered when its call is sent and leaves when the call's response ends, however it
//! ends; ids are the client's, so two calls may share one (each entry counts its calls).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use http::Request;

use super::{one_message, request_id};
use crate::proxy::{Below, Ctx, Picked, RequestBody, Step};
use crate::worker::EngineEntry;

/// The in-flight request ids: id -> (engine, calls).
#[derive(Debug, Default)]
pub struct Requests(Mutex<HashMap<Arc<str>, Calls>>);

/// The engine holding an id's latest call, and how many calls carry the id.
type Calls = (Arc<EngineEntry>, u32);

impl Requests {
    fn enter(self: &Arc<Self>, id: &str, engine: &Arc<EngineEntry>) -> Held {
        let id: Arc<str> = id.into();
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let entry = map.entry(id.clone()).or_insert((engine.clone(), 0));
        // The latest call with an id is the one an Abort means.
        *entry = (engine.clone(), entry.1 + 1);
        Held {
            requests: self.clone(),
            id,
        }
    }

    /// The engine holding `id`, if a call with it is in flight (whether or not the engine is
    /// still in the fleet: its calls are).
    pub fn engine_of(&self, id: &str) -> Option<Arc<EngineEntry>> {
        let map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        map.get(id).map(|(e, _)| e.clone())
    }

    pub fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One call's entry, removed when the response ends (it rides in the response body).
#[derive(Debug)]
pub struct Held {
    requests: Arc<Requests>,
    id: Arc<str>,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut map = self.requests.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = map.get_mut(&self.id) {
            entry.1 -= 1;
            if entry.1 == 0 {
                map.remove(&self.id);
            }
        }
    }
}

#[derive(Clone)]
pub struct Track<S> {
    inner: S,
    ctx: Ctx,
}

impl<S> Track<S> {
    pub fn new(inner: S, ctx: &Ctx) -> Track<S> {
        Track {
            inner,
            ctx: ctx.clone(),
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
        let held = self.ctx.requests().enter(id, &picked.target.engine);
        let fut = self.inner.call(req);
        Step::Own(Box::pin(async move {
            let mut resp = fut.await?;
            resp.body_mut().holds.request_id = Some(held);
            Ok(resp)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_leaves_with_its_last_call() {
        let r = Arc::new(Requests::default());
        let fleet = crate::worker::Fleet::expand(vec![
            crate::worker::test_engine("http://a:1", 1, 0),
            crate::worker::test_engine("http://b:1", 1, 1),
        ]);
        let (one, two) = (&fleet.engines[0], &fleet.engines[1]);
        let of = |id| r.engine_of(id).map(|e| e.key);
        let a = r.enter("x", one);
        let b = r.enter("x", two);
        assert_eq!(of("x"), Some(two.key), "the latest call counts");
        drop(b);
        assert_eq!(of("x"), Some(two.key));
        drop(a);
        assert_eq!(of("x"), None);
        assert!(r.is_empty());
    }
}
