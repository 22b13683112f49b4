//! What rankgate does with a path: the route table of each engine flavor (what is proxied, where
//! the request's model is, how the rank is pinned), the fleet's own `/v1/models`, refusals, and
//! 404 / 405 for the rest.
//!
//! The tables list the engines' HTTP servers' inference endpoints (vLLM's OpenAI server, SGLang's
//! HTTP server); `server.extra_routes` adds paths served by every engine. Administrative
//! endpoints (cache flushes, adapter loading, profiling) are not proxied: one engine of many
//! cannot be their target.

use std::sync::Arc;

use http::{Method, Request, StatusCode};

use super::error::ProxyError;
use super::layer::{Answer, Below, Step};
use super::shared::Ctx;
use crate::catalog::ModelError;
use crate::ix::EngineIx;
use crate::worker::Flavors;

/// Where a request's model is, for routing by model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload {
    /// A JSON object with a top-level `model`.
    Json,
    /// A `multipart/form-data` form with a `model` field (audio).
    Form,
    /// No body (a GET): any engine of the route's flavors.
    Empty,
}

/// A proxied route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proxied {
    pub payload: Payload,
    pub flavors: Flavors,
    /// SGLang takes the rank in this body too (its generation requests carry the field).
    pub sglang_body_pin: bool,
}

const fn post(payload: Payload, flavors: Flavors, sglang_body_pin: bool) -> (Method, Proxied) {
    (
        Method::POST,
        Proxied {
            payload,
            flavors,
            sglang_body_pin,
        },
    )
}

const fn get(flavors: Flavors) -> (Method, Proxied) {
    (
        Method::GET,
        Proxied {
            payload: Payload::Empty,
            flavors,
            sglang_body_pin: false,
        },
    )
}

use Payload::{Form, Json};
const BOTH: Flavors = Flavors::BOTH;
const VLLM: Flavors = Flavors::VLLM;
const SGLANG: Flavors = Flavors::SGLANG;

/// The proxied paths, with their method.
pub fn table(path: &str) -> Option<(Method, Proxied)> {
    Some(match path {
        "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings" => post(Json, BOTH, true),
        "/v1/responses" | "/v1/rerank" | "/v1/score" | "/classify" | "/tokenize"
        | "/detokenize" => post(Json, BOTH, false),
        "/rerank" | "/v2/rerank" | "/score" | "/pooling" | "/v1/messages" => {
            post(Json, VLLM, false)
        }
        "/v1/audio/transcriptions" | "/v1/audio/translations" => post(Form, VLLM, false),
        "/generate" | "/encode" => post(Json, SGLANG, true),
        "/v1/classify" | "/v1/tokenize" | "/v1/detokenize" => post(Json, SGLANG, false),
        "/get_model_info" | "/get_server_info" | "/server_info" => get(SGLANG),
        _ => return None,
    })
}

/// What to do with a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Proxy(Proxied),
    /// The fleet's `/v1/models`, answered by rankgate.
    Models,
    /// `/v1/models/{id}`.
    Model(String),
}

/// Stored responses live on the engine that created them, which rankgate does not track.
pub const STORED_RESPONSES: &str = "stored responses are kept by the engine that created them, and rankgate does not route by response id: send requests with \"store\": false and the whole conversation instead of previous_response_id";

/// Whether `path` is answered by rankgate itself (the model list, a model), whatever the method.
pub fn answered_here(path: &str) -> bool {
    path.strip_prefix("/v1/models")
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// The action for `method` on `path`, or the error the client gets.
pub fn lookup(
    ctx: &Ctx,
    extra_routes: &[String],
    method: &Method,
    path: &str,
) -> Result<Action, ProxyError> {
    let (want, action) = if let Some((m, p)) = table(path) {
        (m, Action::Proxy(p))
    } else if path == "/v1/models" {
        (Method::GET, Action::Models)
    } else if let Some(id) = path.strip_prefix("/v1/models/").filter(|id| !id.is_empty()) {
        (Method::GET, Action::Model(id.to_string()))
    } else if path.starts_with("/v1/responses/") {
        return Err(ProxyError::Refused(STORED_RESPONSES));
    } else if extra_routes.iter().any(|r| r == path) {
        // GET without a body, else POST with the model in JSON (anything else gets 405).
        let (want, payload) = match *method {
            Method::GET => (Method::GET, Payload::Empty),
            _ => (Method::POST, Json),
        };
        let p = Proxied {
            payload,
            flavors: BOTH,
            sglang_body_pin: false,
        };
        (want, Action::Proxy(p))
    } else {
        return Err(ProxyError::NotFound(path.to_string()));
    };
    if want != method {
        return Err(ProxyError::MethodNotAllowed {
            method: method.clone(),
            path: path.to_string(),
            allow: want,
        });
    }
    if let Action::Proxy(p) = &action {
        let serving = ctx.table.snapshot.load().fleet.http.flavors;
        // An empty fleet (engines still to be found) answers 503 at the pick, not 404 here.
        if !serving.is_empty() && !p.flavors.meets(serving) {
            return Err(ProxyError::NoEngineFor(path.to_string()));
        }
    }
    Ok(action)
}

#[derive(Clone)]
pub struct Route<S> {
    inner: S,
    ctx: Ctx,
    /// `server.extra_routes`.
    extra_routes: Arc<[String]>,
}

impl<S> Route<S> {
    pub fn new(inner: S, ctx: &Ctx, extra_routes: &Arc<[String]>) -> Route<S> {
        Route {
            inner,
            ctx: ctx.clone(),
            extra_routes: extra_routes.clone(),
        }
    }
}

impl<S, B> tower::Service<Request<B>> for Route<S>
where
    S: Below<B>,
{
    layer_types!(Step<S::Future>);

    fn call(&mut self, req: Request<B>) -> Self::Future {
        match lookup(
            &self.ctx,
            &self.extra_routes,
            req.method(),
            req.uri().path(),
        ) {
            Ok(Action::Proxy(_)) => Step::Below(self.inner.call(req)),
            Ok(Action::Models) => Step::ready(models(&self.ctx, None)),
            Ok(Action::Model(id)) => Step::ready(models(&self.ctx, Some(&id))),
            Err(e) => Step::ready(Err(e)),
        }
    }
}

/// The fleet's model list, or one model of it: models of engines with fresh telemetry.
fn models(ctx: &Ctx, id: Option<&str>) -> Answer {
    let table = &ctx.table;
    let snap = table.snapshot.load();
    let now = tokio::time::Instant::now();
    let listed = |e: EngineIx| {
        snap.fleet.workers_of(e).any(|w| {
            snap.ranks[w].reachable
                && snap.ranks[w]
                    .telemetry
                    .fresh(now, table.stale_after)
                    .is_some()
        })
    };
    let catalog = &snap.catalog;
    let listing = catalog.listing(listed);
    let Some(id) = id else {
        return Ok(crate::http::json_response(StatusCode::OK, &listing));
    };
    match catalog.entry(id, listed) {
        Some(entry) => Ok(crate::http::json_response(StatusCode::OK, entry)),
        None => Err(ProxyError::Model(ModelError::NotFound {
            model: crate::catalog::shown(id),
            served: listing["data"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m["id"].as_str().map(str::to_string))
                .collect(),
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::Flavor;

    #[test]
    fn every_route_has_one_method_and_the_flavors_that_serve_it() {
        let (m, p) = table("/v1/audio/transcriptions").unwrap();
        assert_eq!((m, p.payload, p.flavors), (Method::POST, Form, VLLM));
        let (m, p) = table("/get_server_info").unwrap();
        assert_eq!((m, p.payload), (Method::GET, Payload::Empty));
        assert!(table("/generate").unwrap().1.sglang_body_pin);
        assert!(!table("/v1/rerank").unwrap().1.sglang_body_pin);
        assert!(
            table("/flush_cache").is_none(),
            "admin endpoints are not proxied"
        );
        assert!(Flavors::VLLM.has(Flavor::Gateway) && !Flavors::VLLM.has(Flavor::Sglang));
    }
}
