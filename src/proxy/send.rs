//! Sending a request to its engine and streaming the answer back.
//!
//! The response must start within `server.response_timeout` (504 otherwise); the same timer then
//! bounds the gaps in the body (`server.stream_idle_timeout`).
//!
//! Connections to one engine are capped (`server.max_engine_connections`; over HTTP/1 that is
//! requests in flight on it), so a burst cannot open more sockets than the engine or this
//! process's file descriptors allow; a request waits for a slot within its response timeout.
//! Upstream failures are classified here, once: the client's broken body stays the client's.
//! The response leaves carrying its rank: the `x-rankgate-worker` header, the target and the
//! request's in-flight mark in its body.

use std::sync::Arc;
use std::time::Duration;

use http::{header, Request, Response};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use tokio::sync::Semaphore;

use super::body::{BodyTooLarge, ClientBodyError};
use super::pin::strip_hop_by_hop;
use super::{Picked, ProxyBody, ProxyError, RequestBody, Shared, WORKER_HEADER};

/// The layer is cloned for every request (tower's `call` takes `&mut self`, so each layer above
/// clones what is below it), so all it holds is one `Arc`.
#[derive(Clone)]
pub struct Send(Arc<State>);

struct State {
    shared: Arc<Shared>,
    client: Client<HttpConnector, RequestBody>,
    /// Per engine: connection slots.
    slots: Vec<Arc<Semaphore>>,
    idle: Duration,
}

impl Send {
    pub fn new(shared: &Arc<Shared>) -> Send {
        let server = &shared.cfg.server;
        let slots = (0..shared.table.fleet.engines.len())
            .map(|_| Arc::new(Semaphore::new(server.max_engine_connections)))
            .collect();
        Send(Arc::new(State {
            shared: shared.clone(),
            client: crate::http::client(server.connect_timeout),
            slots,
            idle: server.stream_idle_timeout,
        }))
    }
}

/// Turns a client error into the proxy's: the client's own body problems first, then the
/// transport.
fn classify(
    e: hyper_util::client::legacy::Error,
    engine: &Arc<str>,
    max_body: usize,
) -> ProxyError {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(s) = src {
        if let Some(c) = s.downcast_ref::<ClientBodyError>() {
            return ProxyError::ClientBody(match c {
                ClientBodyError::Broken(m) => ClientBodyError::Broken(m.clone()),
                ClientBodyError::Stalled(d) => ClientBodyError::Stalled(*d),
            });
        }
        if s.is::<BodyTooLarge>() {
            return ProxyError::TooLarge(max_body);
        }
        src = s.source();
    }
    ProxyError::Upstream {
        engine: engine.clone(),
        reason: crate::http::error_chain(&e),
    }
}

impl tower::Service<Request<Picked>> for Send {
    layer_types!();

    fn call(&mut self, req: Request<Picked>) -> Self::Future {
        let (parts, picked) = req.into_parts();
        let Picked {
            target,
            body,
            guard,
        } = picked;
        let req = Request::from_parts(parts, body);
        let state = self.0.clone();
        Box::pin(async move {
            // One timer serves the whole exchange: the response timeout until the headers, then
            // (moved into the body) the stream idle timeout, so a request costs one timer.
            let limit = state.shared.cfg.server.response_timeout;
            let mut timer = Box::pin(tokio::time::sleep(limit));
            let slots = &state.slots[target.engine];
            let slot = match slots.clone().try_acquire_owned() {
                Ok(s) => s,
                Err(_) => tokio::select! {
                    s = slots.clone().acquire_owned() => {
                        s.map_err(|e| ProxyError::Internal(e.to_string()))?
                    }
                    () = timer.as_mut() => return Err(ProxyError::EngineBusy {
                        limit: state.shared.cfg.server.max_engine_connections,
                        waited: limit,
                    }),
                },
            };
            let resp = tokio::select! {
                biased;
                r = state.client.request(req) => r.map_err(|e| {
                    let engine = &state.shared.table.fleet.engines[target.engine].url;
                    classify(e, engine, state.shared.cfg.server.max_body_bytes)
                })?,
                () = timer.as_mut() => return Err(ProxyError::Timeout(limit)),
            };
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            let sse = parts
                .headers
                .get(header::CONTENT_TYPE)
                .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
            parts
                .headers
                .insert(WORKER_HEADER, state.shared.worker_header(target.worker));
            let mut body = ProxyBody::upstream(body, sse, state.idle, Some(timer));
            body.holds.connection = Some(slot);
            body.holds.in_flight = Some(guard);
            body.target = Some(target);
            Ok(Response::from_parts(parts, body))
        })
    }
}
