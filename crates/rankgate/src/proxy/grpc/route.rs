//! The gRPC method table as a layer: proxied calls go down the stack with the ranks they may
//! go to; Abort, FlushCache, GetLoads and health are answered here (see `local`); the rest is
//! UNIMPLEMENTED.

use std::sync::Arc;

use http::{header, Method, Request, StatusCode};
use hyper::body::Incoming;
use tonic::Code;

use super::calls::{
    call, flavor_of, parse_path, Call, HEALTH_SERVICE, SGLANG_SERVICE, VLLM_SERVICE,
};
use super::local::{self, targets, Local};
use crate::proxy::error::GrpcError;
use crate::proxy::layer::{Below, Step};
use crate::proxy::shared::Ctx;

/// The method table in front of the rest of the stack.
#[derive(Clone)]
pub struct Route<S> {
    inner: S,
    ctx: Ctx,
    local: Arc<Local>,
}

impl<S> Route<S> {
    pub fn new(inner: S, ctx: &Ctx, local: &Arc<Local>) -> Route<S> {
        Route {
            inner,
            ctx: ctx.clone(),
            local: local.clone(),
        }
    }
}

impl<S> tower::Service<Request<Incoming>> for Route<S>
where
    S: Below<Incoming>,
{
    layer_types!(Step<S::Future>);

    fn call(&mut self, mut req: Request<Incoming>) -> Self::Future {
        let is_grpc = req
            .headers()
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
        // The gRPC protocol (PROTOCOL-HTTP2.md): a request that is not gRPC gets 415, so that no
        // HTTP client reads the gRPC error's 200 as an answer.
        if req.method() != Method::POST || !is_grpc {
            return Step::ready(Err(GrpcError::not_grpc(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "the gRPC listener takes gRPC calls: POST with content-type application/grpc",
            )
            .into()));
        }
        // A call's status comes in trailers, which an HTTP/1.1 answer cannot carry: the client
        // could never read the engine's verdict.
        if req.version() != http::Version::HTTP_2 {
            return Step::ready(Err(GrpcError::not_grpc(
                StatusCode::HTTP_VERSION_NOT_SUPPORTED,
                "gRPC needs HTTP/2 (h2c, prior knowledge)",
            )
            .into()));
        }
        let path = req.uri().path().to_owned();
        let unimplemented =
            |what: String| Step::ready(Err(GrpcError::new(Code::Unimplemented, what).into()));
        let Some((service, method)) = parse_path(&path) else {
            return unimplemented(format!(
                "{path} is not a gRPC method path (/service/method)"
            ));
        };
        if service == HEALTH_SERVICE {
            return Step::Own(Box::pin(local::health(
                self.ctx.clone(),
                self.local.clone(),
                req,
            )));
        }
        let Some(flavor) = flavor_of(service) else {
            return unimplemented(format!(
                "service {service} is not served: rankgate fronts {VLLM_SERVICE} and {SGLANG_SERVICE}"
            ));
        };
        let Some(avoid) = targets(&self.ctx, flavor) else {
            let snap = self.ctx.table.snapshot.load();
            let split = (snap.fleet.engines.iter())
                .any(|e| e.grpc.is_some() && e.flavor == flavor && e.role.disaggregated());
            return unimplemented(match split {
                true => format!(
                    "service {service}: this fleet's {flavor} engines with a grpc_url are prefill or decode servers, and a disaggregated request is served through the OpenAI HTTP front door only (the engines' gRPC generate call carries no KV transfer parameters)"
                ),
                false => format!("service {service}: no {flavor} engine in this fleet has a grpc_url"),
            });
        };
        let (ctx, here) = (self.ctx.clone(), self.local.clone());
        match call(flavor, method) {
            None => unimplemented(format!("method {path} is not served by rankgate")),
            Some(Call::Proxy { .. }) => {
                req.extensions_mut().insert(avoid);
                Step::Below(self.inner.call(req))
            }
            Some(Call::GetLoads) => Step::Own(Box::pin(local::get_loads(ctx, here, flavor, req))),
            Some(Call::Abort) => Step::Own(Box::pin(local::abort(here, flavor, req))),
            Some(Call::FlushCache) => {
                Step::Own(Box::pin(local::flush_cache(ctx, here, flavor, req)))
            }
        }
    }
}
