//! The stacks, assembled: each layer is given its own state and settings when the stack is
//! built ([`Layers`], made once per router from the config), and the HTTP and gRPC front doors
//! share the lower half (read, admit, retry, pick, observe, send). One stack per connection.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;
use tower::ServiceBuilder;

use super::auth::{Gate, Keys};
use super::body::ProxyBody;
use super::dial::Dial;
use super::exposure::Exposure;
use super::flow::Flows;
use super::grpc::{Local, Requests};
use super::read::Limits;
use super::respond::Errors;
use super::retry::Policy;
use super::shared::{Ctx, Front, Shared};
use super::{
    admit, auth, cors, disagg, flow, grpc, identity, observe, pick, read, respond, retry, route,
    select, tokens,
};
use super::{send, trace};
use crate::config::Config;
use crate::deadlines::Deadlines;
use crate::metrics::Metrics;
use crate::policy::Selector;
use crate::table::Table;
use crate::tls::Upstream;

/// What the stacks of one router are built from: the state every layer shares, and each
/// layer's own (settings, and counters that must be one for all connections), made once.
pub struct Layers {
    shared: Arc<Shared>,
    /// `server.trusted_proxies`, and the scheme of the front doors.
    forwarding: Arc<identity::Forwarding>,
    /// `server.cors_allow_origins`; `None`: CORS is off.
    origins: Option<Arc<[String]>>,
    errors: Arc<Errors>,
    gate: Arc<Gate>,
    /// `server.extra_routes`.
    extra_routes: Arc<[String]>,
    limits: Limits,
    admission: Option<Arc<admit::Admission>>,
    /// The queue (`[flow]`); `None`: flow control is off.
    flows: Option<Arc<Flows>>,
    retry: Arc<Policy>,
    ejection: crate::outlier::Policy,
    dial: Arc<Dial>,
    grpc: Arc<Local>,
    /// `[[models]]`' tokenizers while `routing.kv_events` is on; `None` otherwise.
    prompts: Option<Arc<tokens::State>>,
}

impl std::fmt::Debug for Layers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Layers")
    }
}

impl Layers {
    /// `keys` as [`Keys::load`] read them at startup; `upstream` as `[engine_tls]` says;
    /// `prompts`: the models' tokenizers, loaded at startup ([`crate::prompt::Prompts::load`]).
    pub fn new(
        cfg: &Config,
        table: Arc<Table>,
        metrics: Arc<Metrics>,
        keys: Option<Keys>,
        upstream: &Upstream,
        prompts: crate::prompt::Prompts,
    ) -> Arc<Layers> {
        let (server, routing) = (&cfg.server, &cfg.routing);
        let deadlines = Deadlines::of(server);
        let limits = Limits {
            max_body: server.max_body_bytes,
            retry_buffer: routing.retry_buffer_bytes,
            stall: deadlines.body_read,
            whole: deadlines.body,
        };
        let ejection = crate::outlier::Policy {
            after: routing.eject_after,
            base: routing.eject_for,
        };
        let dial = Arc::new(Dial::new(
            server.max_engine_connections,
            server.max_body_bytes,
            deadlines,
            upstream,
            Exposure::new(server.expose_worker),
            ejection,
        ));
        let flow = &cfg.flow;
        let selector =
            Arc::new(Selector::new(routing).judging(flow.enabled.then_some(flow.saturation)));
        let flows = flow.enabled.then(|| Flows::new(flow, &selector, &table));
        let loader = crate::adapter_loads::Loader::new(table.clone(), upstream, metrics.clone());
        let shared = Arc::new(Shared {
            table,
            selector,
            metrics,
            clients: super::streams::ClientStreams::new(server.streams_per_client()),
            trusted: server.trusted_proxies.clone().into(),
            loader,
        });
        Arc::new(Layers {
            forwarding: Arc::new(identity::Forwarding::new(
                &server.trusted_proxies,
                server.tls.is_some(),
            )),
            origins: (!server.cors_allow_origins.is_empty())
                .then(|| server.cors_allow_origins.clone().into()),
            errors: Arc::new(Errors::new(
                server.access_log,
                routing.retry_after_secs,
                Exposure::new(server.expose_worker),
            )),
            gate: Arc::new(Gate {
                keys,
                debug_token: (server.admin_token.as_ref()).map(|t| Keys::single(&t.0)),
            }),
            extra_routes: server.extra_routes.clone().into(),
            limits,
            admission: server
                .max_in_flight
                .map(|limit| Arc::new(admit::Admission::new(limit))),
            flows,
            retry: Arc::new(Policy::new(
                routing.max_attempts,
                routing.retry_budget,
                &routing.retry_on,
            )),
            ejection,
            grpc: Arc::new(Local {
                requests: Arc::new(Requests::default()),
                draining: Arc::default(),
                limits,
                dial: dial.clone(),
            }),
            dial,
            shared,
            prompts: (cfg.routing.kv_events && prompts.any()).then(|| {
                Arc::new(tokens::State::new(
                    prompts,
                    crate::http::client_with(server.connect_timeout, upstream),
                ))
            }),
        })
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Flow control's queue, when `[flow]` is on.
    pub fn flows(&self) -> Option<&Arc<Flows>> {
        self.flows.as_ref()
    }

    /// Set once shutdown begins: the gRPC health service then says NOT_SERVING.
    pub fn draining(&self) -> &Arc<AtomicBool> {
        &self.grpc.draining
    }

    /// The switch that fails every engine connection at once (shutdown's last step).
    pub fn cutoff(&self) -> &crate::upstream::Cutoff {
        &self.dial.cutoff
    }
}

/// The answer every stack gives (errors included), the way the accept loop takes it.
pub trait FrontDoor:
    tower::Service<
        Request<Incoming>,
        Response = Response<ProxyBody>,
        Error = Infallible,
        Future: Future + Send + 'static,
    > + Clone
    + Send
    + Unpin
    + 'static
{
}

impl<S> FrontDoor for S where
    S: tower::Service<
            Request<Incoming>,
            Response = Response<ProxyBody>,
            Error = Infallible,
            Future: Future + Send + 'static,
        > + Clone
        + Send
        + Unpin
        + 'static
{
}

/// The OpenAI HTTP front door for one connection, on the engine connections of `core`
/// (thread-per-core; else 0).
pub fn stack(layers: &Layers, core: usize, peer: SocketAddr) -> impl FrontDoor {
    let ctx = Ctx::on(&layers.shared, core, peer, Front::Http);
    let (l, c) = (layers, &ctx);
    ServiceBuilder::new()
        .layer_fn(|inner| l.identity(inner, c))
        .layer_fn(|inner| trace::Trace::new(inner, c))
        .layer_fn(|inner| l.cors(inner, c))
        .layer_fn(|inner| l.respond(inner, c))
        .layer_fn(|inner| l.auth(inner))
        .layer_fn(|inner| l.route(inner, c))
        .layer_fn(|inner| l.read(inner, c))
        .layer_fn(|inner| select::Select::new(inner, c, &l.extra_routes))
        .layer_fn(|inner| tokens::Tokens::new(inner, c, &l.prompts))
        .layer_fn(|inner| l.admit(l.flow(l.disagg(l.retry(l.pick(inner, c), c), c), c)))
        .service(l.observe_send(c))
}

/// The gRPC front door for one connection (see [`grpc`]): the method table over the HTTP
/// stack's lower half, answering every call (errors as gRPC statuses).
pub fn grpc_stack(layers: &Layers, peer: SocketAddr) -> impl FrontDoor {
    let ctx = Ctx::new(&layers.shared, peer, Front::Grpc);
    let (l, c) = (layers, &ctx);
    ServiceBuilder::new()
        .layer_fn(|inner| l.identity(inner, c))
        .layer_fn(|inner| trace::Trace::new(inner, c))
        .layer_fn(|inner| l.respond(inner, c))
        .layer_fn(|inner| l.auth(inner))
        .layer_fn(|inner| grpc::Route::new(inner, c, &l.grpc))
        .layer_fn(|inner| l.read(inner, c))
        .layer_fn(|inner| l.admit_retry_pick(inner, c))
        .layer_fn(|inner| grpc::Track::new(inner, &l.grpc.requests))
        .service(l.observe_send(c))
}

/// Each layer over `inner`, with its own state and settings: the stacks above and the layers'
/// tests build them here.
impl Layers {
    pub(super) fn identity<S>(&self, inner: S, c: &Ctx) -> identity::Identity<S> {
        identity::Identity::new(inner, c, &self.forwarding)
    }

    pub(super) fn cors<S>(&self, inner: S, c: &Ctx) -> cors::Cors<S> {
        cors::Cors::new(inner, c, &self.origins, &self.errors)
    }

    pub(super) fn respond<S>(&self, inner: S, c: &Ctx) -> respond::Respond<S> {
        respond::Respond::new(inner, c, &self.errors)
    }

    pub(super) fn auth<S>(&self, inner: S) -> auth::Auth<S> {
        auth::Auth::new(inner, &self.gate)
    }

    pub(super) fn route<S>(&self, inner: S, c: &Ctx) -> route::Route<S> {
        route::Route::new(inner, c, &self.extra_routes)
    }

    pub(super) fn read<S>(&self, inner: S, c: &Ctx) -> read::Read<S> {
        read::Read::new(inner, c, self.limits)
    }

    pub(super) fn admit<S>(&self, inner: S) -> admit::Admit<S> {
        admit::Admit::new(inner, &self.admission)
    }

    pub(super) fn flow<S>(&self, inner: S, c: &Ctx) -> flow::Flow<S> {
        flow::Flow::new(inner, c, &self.flows)
    }

    pub(super) fn disagg<S>(&self, inner: S, c: &Ctx) -> disagg::Disagg<S> {
        disagg::Disagg::new(
            inner,
            c,
            self.limits.max_body,
            self.dial.response,
            &self.retry,
            self.errors.access_log(),
        )
    }

    pub(super) fn retry<S>(&self, inner: S, c: &Ctx) -> retry::Retry<S> {
        retry::Retry::new(inner, c, &self.retry)
    }

    pub(super) fn pick<S>(&self, inner: S, c: &Ctx) -> pick::Pick<S> {
        pick::Pick::new(inner, c, self.limits.max_body)
    }

    pub(super) fn observe<S>(&self, inner: S, c: &Ctx) -> observe::Observe<S> {
        observe::Observe::new(inner, c, self.ejection)
    }

    /// The lower half both front doors share, above and below what only one of them has
    /// (gRPC's `track` between pick and observe).
    fn admit_retry_pick<S>(
        &self,
        inner: S,
        c: &Ctx,
    ) -> admit::Admit<flow::Flow<retry::Retry<pick::Pick<S>>>> {
        self.admit(self.flow(self.retry(self.pick(inner, c), c), c))
    }

    fn observe_send(&self, c: &Ctx) -> observe::Observe<send::Send> {
        self.observe(send::Send::new(c, &self.dial), c)
    }
}
