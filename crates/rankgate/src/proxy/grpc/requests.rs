//! Which engine holds each in-flight gRPC request id, so that an `Abort` reaches the engine
//! generating the request (another engine would answer OK and abort nothing). An id is entered
//! when its call is sent and leaves when the call's response ends, however it ends ([`Held`]
//! rides in the response body); ids are the client's, so two calls may share one (each entry
//! counts its calls).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::worker::EngineEntry;

/// The in-flight request ids: id -> (engine, calls).
#[derive(Debug, Default)]
pub struct Requests(Mutex<HashMap<Arc<str>, Calls>>);

/// The engine holding an id's latest call, and how many calls carry the id.
type Calls = (Arc<EngineEntry>, u32);

impl Requests {
    pub(super) fn enter(self: &Arc<Self>, id: &str, engine: &Arc<EngineEntry>) -> Held {
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

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ix::{EngineIx, Ix};

    #[test]
    fn an_id_leaves_with_its_last_call() {
        let r = Arc::new(Requests::default());
        let fleet = crate::worker::Fleet::expand(vec![
            crate::worker::test_engine("http://a:1", 1, 0),
            crate::worker::test_engine("http://b:1", 1, 1),
        ]);
        let (one, two) = (
            &fleet.engines[EngineIx::new(0)],
            &fleet.engines[EngineIx::new(1)],
        );
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
