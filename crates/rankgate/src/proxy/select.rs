//! The engines that may serve a request: those serving its model (read from the body without
//! parsing it: [`super::scan`]) and its route's flavor. The pick then applies every rule about
//! ranks within that set; the others are handed down as engines to avoid.
//!
//! A fleet whose lists are all unknown is not scanned at all, one serving one model only up to
//! a `model` naming it (usually the body's first member: a request naming another gets the
//! fleet's own 404), and a fleet of one flavor needs no flavor check: the usual request passes
//! straight through. With `[[routes]]`, the body is scanned for its model first, and a model
//! naming a route rewritten to its target ([`super::reroute`]); what the scan read is used
//! below, not read again.

use std::borrow::Cow;
use std::sync::Arc;

use http::{header, Request};

use super::disagg::Split;
use super::error::ProxyError;
use super::layer::{Below, Step};
use super::reroute::{self, Named};
use super::route::{self, Action, Payload, Proxied};
use super::shared::Ctx;
use crate::catalog::ModelError;
use crate::metrics::ModelSlot;
use crate::policy::Avoid;
use crate::scan::{self, ScanError};
use crate::table::Snapshot;
use crate::upstream::RequestBody;
use crate::worker::{EngineId, Flavor, Role};

#[derive(Clone)]
pub struct Select<S> {
    inner: S,
    ctx: Ctx,
    /// `server.extra_routes`.
    extra_routes: Arc<[String]>,
}

impl<S> Select<S> {
    pub fn new(inner: S, ctx: &Ctx, extra_routes: &Arc<[String]>) -> Select<S> {
        Select {
            inner,
            ctx: ctx.clone(),
            extra_routes: extra_routes.clone(),
        }
    }
}

impl<S> tower::Service<Request<RequestBody>> for Select<S>
where
    S: Below<RequestBody> + Clone + Send + 'static,
{
    layer_types!(Step<S::Future>);

    fn call(&mut self, mut req: Request<RequestBody>) -> Self::Future {
        match self.choose(&mut req) {
            Ok(chosen) => chosen.mark(&mut req),
            Err(ProxyError::Model(e)) => {
                return match self.declared(&e) {
                    Some(adapter) => self.after_load(req, adapter),
                    None if matches!(e, ModelError::NotFound { .. })
                        && self.recheck_round().is_some() =>
                    {
                        self.after_recheck(req)
                    }
                    None => Step::ready(Err(e.into())),
                };
            }
            Err(e) => return Step::ready(Err(e)),
        }
        Step::Below(self.inner.call(req))
    }
}

impl<S> Select<S>
where
    S: Below<RequestBody> + Clone + Send + 'static,
{
    /// The recheck round a request for an unlisted model waits for; `None`: the lists are
    /// fresh, the model is not there.
    fn recheck_round(&self) -> Option<u64> {
        self.ctx.table.recheck.ask()
    }

    /// The declared adapter (`[[adapters]]`) a model error names: the model no list has, or
    /// the route's target none has.
    fn declared(&self, e: &ModelError) -> Option<crate::model_routes::Declared> {
        let model = match e {
            ModelError::NotFound { model, .. } => model,
            ModelError::RouteTarget { target, .. } => target,
            ModelError::Missing(_) => return None,
        };
        let snap = self.ctx.table.snapshot.load();
        snap.catalog.routes().declared(model).cloned()
    }

    /// A declared adapter no list names: loaded on a server of its base model (or the load
    /// running waited for, [`crate::adapter_loads`]), and the request judged again on the
    /// lists read after it. The usual request never comes here.
    fn after_load(
        &mut self,
        mut req: Request<RequestBody>,
        adapter: crate::model_routes::Declared,
    ) -> Step<S::Future> {
        let mut inner = self.inner.clone();
        std::mem::swap(&mut inner, &mut self.inner);
        let this = self.detached();
        Step::Own(Box::pin(async move {
            let server = this.ctx.loader.ensure(&adapter).await?;
            match this.choose(&mut req) {
                Ok(chosen) => chosen.mark(&mut req),
                Err(ProxyError::Model(_)) => {
                    return Err(crate::adapter_loads::LoadError::NotListed {
                        adapter: adapter.name.to_string(),
                        server: server.to_string(),
                    }
                    .into())
                }
                Err(e) => return Err(e),
            }
            inner.call(req).await
        }))
    }

    /// This layer without its service, for a request that goes on in a future of its own.
    fn detached(&self) -> Select<()> {
        Select {
            inner: (),
            ctx: self.ctx.clone(),
            extra_routes: self.extra_routes.clone(),
        }
    }

    /// A model no list names: the lists are read again at once (see [`crate::recheck`]), and
    /// the request is judged again on what they say, within [`crate::recheck::WAIT`]. The
    /// usual request never comes here.
    fn after_recheck(&mut self, mut req: Request<RequestBody>) -> Step<S::Future> {
        let round = self.ctx.table.recheck.newest();
        // The service that is ready goes with the request; this one gets a fresh clone.
        let mut inner = self.inner.clone();
        std::mem::swap(&mut inner, &mut self.inner);
        let this = self.detached();
        Step::Own(Box::pin(async move {
            this.ctx
                .table
                .recheck
                .wait(round, crate::recheck::WAIT)
                .await;
            this.choose(&mut req)?.mark(&mut req);
            inner.call(req).await
        }))
    }
}

impl Chosen {
    /// Puts on the request where it may go.
    fn mark(self, req: &mut Request<RequestBody>) {
        match self {
            Chosen::Any => {}
            Chosen::Only(avoid) => {
                req.extensions_mut().insert(avoid);
            }
            Chosen::Split(split) => {
                req.extensions_mut().insert(*split);
            }
        }
    }
}

/// Which ranks may serve a request.
enum Chosen {
    /// Any that serves its front door: nothing to look at.
    Any,
    /// Those of these engines.
    Only(Avoid),
    /// A prefill rank, then a decode rank (a model served disaggregated).
    Split(Box<Split>),
}

/// The routes a disaggregated model serves in two legs: generation. The rest (embeddings,
/// tokenizer, models) go whole to any of its engines.
fn split_route(path: &str) -> bool {
    matches!(
        path,
        "/v1/chat/completions" | "/v1/completions" | "/generate"
    )
}

impl<S> Select<S> {
    /// Where the request may go, its model first rewritten when it names a route.
    fn choose(&self, req: &mut Request<RequestBody>) -> Result<Chosen, ProxyError> {
        // The snapshot's guard is let go before the layers below, which load their own.
        let snap = self.ctx.table.snapshot.load();
        // Without routes (the usual fleet) this one look is all they cost.
        let named = match snap.catalog.routes().is_empty() {
            true => None,
            false => self.reroute(req, &snap),
        };
        let chosen = self.avoid(req, &snap, named.as_ref());
        match named {
            Some(named) => chosen.map_err(|e| named.explain(e)),
            None => chosen,
        }
    }

    /// A request naming a route, rewritten to its target; the model it names, if read.
    fn reroute(&self, req: &mut Request<RequestBody>, snap: &Snapshot) -> Option<Named> {
        let (method, path) = (req.method(), req.uri().path());
        let Ok(Action::Proxy(route)) = route::lookup(&self.ctx, &self.extra_routes, method, path)
        else {
            return None;
        };
        reroute::apply(req, route.payload, snap.catalog.routes())
    }

    /// The engines the request may go to, and whether in two legs. `named`: its model, when
    /// `reroute` read it.
    fn avoid(
        &self,
        req: &Request<RequestBody>,
        snap: &Snapshot,
        named: Option<&Named>,
    ) -> Result<Chosen, ProxyError> {
        let ctx = &self.ctx;
        let path = req.uri().path();
        let mixed_flavors = snap.fleet.http.mixed_flavors;
        let split = snap.fleet.http.disaggregated && split_route(path);
        // The usual request: one model, one flavor, nothing to look at (engines that serve no
        // HTTP are left out by the pick itself).
        let usual = !snap.catalog.routes_by_model() && !snap.catalog.lists_pending();
        if usual && !mixed_flavors && !split && path != "/v1/responses" {
            // One model served: a request naming another is answered here (`not_served`).
            let full = matches!(req.body(), RequestBody::Full(_));
            if let (Some(sole), true) = (snap.catalog.sole_model(), full) {
                if let Ok(Action::Proxy(route)) =
                    route::lookup(ctx, &self.extra_routes, req.method(), path)
                {
                    not_served(req, route, sole, named)?;
                }
            }
            return Ok(Chosen::Any);
        }
        let Action::Proxy(route) = route::lookup(ctx, &self.extra_routes, req.method(), path)?
        else {
            return Ok(Chosen::Any);
        };
        // `read` kept this body whole. One that is not JSON is the engine's to refuse.
        if let (true, RequestBody::Full(body)) = (path == "/v1/responses", req.body()) {
            if let Ok(Some(_)) | Err(ScanError::NotString(_)) =
                scan::json_member(body, "previous_response_id")
            {
                return Err(ProxyError::Refused(route::STORED_RESPONSES));
            }
        }
        // Declared adapters are looked for even before any list is known: one no list has is
        // loaded, not sent to an engine whose list is unknown (whose 404 would say nothing).
        let declares = !snap.catalog.routes().adapters().is_empty();
        let by_model =
            (snap.catalog.routes_by_model() || declares) && route.payload != Payload::Empty;
        if let Some(sole) = snap.catalog.sole_model() {
            not_served(req, route, sole, named)?;
        }
        // Before the engines' model lists are read, a request naming its model is labelled
        // with it (`Metrics::model` bounds how many names), not `unknown`.
        if let (false, true, Some(slot)) = (
            by_model,
            snap.catalog.lists_pending() && route.payload != Payload::Empty,
            req.extensions().get::<ModelSlot>(),
        ) {
            if let Ok(Some(m)) = read_model(req, route, named) {
                slot.set(ctx.metrics.model(&m, snap));
            }
        }
        if !by_model && !split && (!mixed_flavors || route.flavors == crate::worker::Flavors::BOTH)
        {
            return Ok(Chosen::Any);
        }
        let model = match by_model {
            true => read_model(req, route, named)?,
            false => None,
        };
        // `respond` labels the request with its model: one the catalog knows, else `unknown`.
        if let (Some(slot), Some(m)) = (req.extensions().get::<ModelSlot>(), &model) {
            slot.set(ctx.metrics.model(m, snap));
        }
        if let Some(m) = (model.as_deref()).filter(|m| declares && !snap.catalog.listed(m)) {
            if snap.catalog.routes().declared(m).is_some() {
                return Err(ModelError::NotFound {
                    model: crate::catalog::shown(m),
                    served: Vec::new(),
                }
                .into());
            }
        }
        let engines = &snap.fleet.engines;
        let serving = match by_model {
            true => snap.catalog.engines_for(model.as_deref(), |e| {
                engines[e].http && route.flavors.has(engines[e].flavor)
            })?,
            false => engines.indices().collect(),
        };
        let only: Vec<_> = (serving.into_iter().map(|e| &engines[e]))
            .filter(|e| e.http && route.flavors.has(e.flavor))
            .map(|e| e.key)
            .collect();
        if only.is_empty() {
            let what = match model {
                Some(m) => format!("{path} for model `{}`", crate::catalog::shown(&m)),
                None => path.to_string(),
            };
            return Err(ProxyError::NoEngineFor(what));
        }
        let mut avoid = Avoid::default();
        if let Some(m) = model.as_deref().filter(|m| !snap.catalog.listed(m)) {
            avoid.unlisted_model = Some(crate::catalog::shown(m).into());
        }
        avoid.adapter = (model.as_deref()).and_then(|m| snap.catalog.adapter(m).cloned());
        if split {
            // A side whose servers' model lists are not known yet (just joined) would be
            // missing from `only` while the other side's list has the model: those may serve.
            let unknown = (engines.iter_enumerated())
                .filter(|(e, entry)| {
                    snap.catalog.of(*e).is_none()
                        && entry.http
                        && entry.role.disaggregated()
                        && !only.contains(&entry.key)
                })
                .map(|(_, entry)| entry.key)
                .collect::<Vec<_>>();
            let model = model.as_deref().map(crate::catalog::shown);
            let sides = (&only[..], &unknown[..]);
            let legs = two_legs(&snap.fleet, sides, model.as_deref(), &avoid);
            if let Err(ProxyError::NotDisaggregable(why)) = &legs {
                // Counted and logged (once) as a side that fails every request.
                super::disagg::health::unpaired(&ctx.metrics.pd, why);
            }
            if let Some(split) = legs? {
                return Ok(Chosen::Split(Box::new(split)));
            }
        }
        avoid.only(only);
        Ok(Chosen::Only(avoid))
    }
}

/// The two legs of a request the engines `known` may serve (else, on a side none of them
/// is on, those of `unknown`, whose model lists are not known yet), when some of them are
/// prefill or decode servers; `None` when none is (whole engines serve it). Whole engines
/// beside them take no part in a split request.
fn two_legs(
    fleet: &crate::worker::Fleet,
    (known, unknown): (&[EngineId], &[EngineId]),
    model: Option<&str>,
    base: &Avoid,
) -> Result<Option<Split>, ProxyError> {
    let among = |set: &[EngineId], role: Role| -> Vec<EngineId> {
        (fleet.engines.iter())
            .filter(|e| e.role == role && set.contains(&e.key))
            .map(|e| e.key)
            .collect()
    };
    let of = |role: Role| match among(known, role) {
        found if found.is_empty() => among(unknown, role),
        found => found,
    };
    let (prefill, decode) = (of(Role::Prefill), of(Role::Decode));
    let what = match model {
        Some(m) => format!("model `{m}`"),
        None => "this fleet's model".to_string(),
    };
    let missing = match (prefill.is_empty(), decode.is_empty()) {
        (true, true) => return Ok(None),
        (false, false) => None,
        (true, false) => Some(("prefill", "decode")),
        (false, true) => Some(("decode", "prefill")),
    };
    if let Some((missing, present)) = missing {
        return Err(ProxyError::NotDisaggregable(format!(
            "{what} is served disaggregated and has no {missing} server: add one, or give its {present} servers role \"both\""
        )));
    }
    // An engine that has not said its flavor yet has no ranks: it decides nothing.
    let mut flavors = (fleet.engines.iter())
        .filter(|e| prefill.contains(&e.key) || decode.contains(&e.key))
        .filter(|e| e.shaped())
        .map(|e| e.flavor);
    let flavor = flavors.next().unwrap_or(Flavor::Vllm);
    if flavors.any(|f| f != flavor) {
        return Err(ProxyError::NotDisaggregable(format!(
            "{what} is served by prefill and decode servers of different flavors, whose KV transfers cannot meet: serve it with vLLM or SGLang servers only"
        )));
    }
    Ok(Some(Split {
        prefill,
        decode,
        flavor,
        base: base.clone(),
    }))
}

/// The body, or as much of it as was read (`read` keeps it whole when the fleet routes by
/// model; only a fleet that began to while this request was read has part of it).
fn whole(req: &Request<RequestBody>) -> Option<&[u8]> {
    match req.body() {
        RequestBody::Full(b) => Some(b),
        RequestBody::Stream(s) => s.prefix.as_deref(),
    }
}

/// A fleet serving one model (`sole`, every engine's list known) answers a request naming
/// another itself, as one serving several does: 404 `model_not_found`, naming the model it
/// serves, rather than one engine's own 404. The body is scanned only up to its first member
/// naming `sole` (the usual request names it first); a body too large to have been kept whole,
/// or naming no model, goes on as before (its engine answers). `named`: the model `reroute`
/// read, when it did.
fn not_served(
    req: &Request<RequestBody>,
    route: Proxied,
    sole: &str,
    named: Option<&Named>,
) -> Result<(), ProxyError> {
    let RequestBody::Full(body) = req.body() else {
        return Ok(());
    };
    let other = match (named, route.payload) {
        (Some(n), _) => n.model.as_deref().filter(|m| *m != sole).map(Cow::Borrowed),
        (None, Payload::Json) => scan::json_member_other(body, "model", sole),
        (None, Payload::Form) => model(req, route).ok().flatten().filter(|m| m != sole),
        (None, Payload::Empty) => None,
    };
    match other {
        Some(m) => Err(crate::catalog::ModelError::NotFound {
            model: crate::catalog::shown(&m),
            served: vec![sole.to_string()],
        }
        .into()),
        None => Ok(()),
    }
}

/// The request's `model`: as `reroute` read it (`named`), else from wherever its route carries
/// it.
fn read_model<'a>(
    req: &'a Request<RequestBody>,
    route: Proxied,
    named: Option<&'a Named>,
) -> Result<Option<Cow<'a, str>>, ScanError> {
    match named {
        Some(n) => Ok(n.model.as_deref().map(Cow::Borrowed)),
        None => model(req, route),
    }
}

/// The request's `model`, from wherever its route carries it.
fn model(req: &Request<RequestBody>, route: Proxied) -> Result<Option<Cow<'_, str>>, ScanError> {
    let body = whole(req).unwrap_or_default();
    match route.payload {
        Payload::Json => scan::json_member(body, "model"),
        Payload::Form => {
            let boundary = req
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .and_then(scan::boundary)
                .ok_or(ScanError::NotForm)?;
            Ok(scan::form_field(body, boundary, "model"))
        }
        Payload::Empty => Ok(None),
    }
}
