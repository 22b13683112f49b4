//! Routing by path and method: what rankgate proxies, and 404 / 405 for the rest.

use http::{Method, Request};

use super::{Below, ProxyError, Step};

#[derive(Clone)]
pub struct Route<S> {
    inner: S,
}

impl<S> Route<S> {
    pub fn new(inner: S) -> Route<S> {
        Route { inner }
    }
}

/// The method a proxied path takes, or `None` for a path rankgate does not serve.
fn method_of(path: &str) -> Option<Method> {
    match path {
        "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings" => Some(Method::POST),
        "/v1/models" => Some(Method::GET),
        _ => None,
    }
}

impl<S, B> tower::Service<Request<B>> for Route<S>
where
    S: Below<B>,
{
    layer_types!(Step<S::Future>);

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let path = req.uri().path();
        match method_of(path) {
            Some(m) if m == req.method() => Step::Below(self.inner.call(req)),
            Some(_) => Step::ready(Err(ProxyError::MethodNotAllowed {
                method: req.method().clone(),
                path: path.to_string(),
            })),
            None => Step::ready(Err(ProxyError::NotFound(path.to_string()))),
        }
    }
}
