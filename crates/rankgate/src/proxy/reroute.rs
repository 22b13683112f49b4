//! Model routes applied to a request (`[[routes]]`, [`crate::model_routes`]): a body whose
//! `model` names a route has it rewritten to the target chosen for it, once, in `select` before
//! the model decides anything, so every layer below (the engines chosen, the pick, prefix
//! affinity, the disaggregated legs, retries, the `model` label) sees the target only.
//! Responses are not rewritten: the engine answers with the target's name, which is the model
//! that served the request.
//!
//! Only the value of `model` changes: the body is spliced where the scan found the value (for
//! JSON the last `model` member, the one the scan and the engines' parsers read; for a form its
//! `model` field), every other byte as the client sent it. The scan that finds the route is the
//! one `select` would have made: what it read is handed on ([`Named`]), not read again. A fleet
//! without routes never comes here (`select` looks at `Routes::is_empty` first: one branch).

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderMap, Request};

use super::error::ProxyError;
use super::route::Payload;
use crate::catalog::ModelError;
use crate::model_routes::Routes;
use crate::scan;
use crate::upstream::RequestBody;

/// The model a request names, read once here for `select`.
#[derive(Debug, Clone, PartialEq)]
pub struct Named {
    /// As the body now has it (the target, when it named a route); `None`: it names none.
    pub model: Option<String>,
    /// The route it named, if any.
    pub route: Option<Arc<str>>,
}

impl Named {
    /// `select`'s error for this request: a target no engine serves is said as the route's, so
    /// the client learns which name it sent and where that leads.
    pub fn explain(&self, e: ProxyError) -> ProxyError {
        match (e, &self.route) {
            (ProxyError::Model(ModelError::NotFound { model, served }), Some(route)) => {
                ModelError::RouteTarget {
                    route: crate::catalog::shown(route),
                    target: model,
                    served,
                }
                .into()
            }
            (e, _) => e,
        }
    }
}

/// Rewrites `req`'s model to a target when it names one of `routes`; the model it names then.
/// `None` when the body cannot be read for its model here (not kept whole, not a JSON object,
/// a `model` that is not a string, a form without a boundary): `select` reads it as it always
/// did, and answers its errors.
pub fn apply(req: &mut Request<RequestBody>, payload: Payload, routes: &Routes) -> Option<Named> {
    let RequestBody::Full(body) = req.body() else {
        return None;
    };
    let (model, at) = match payload {
        Payload::Json => json_model(body)?,
        Payload::Form => form_model(req.headers(), body)?,
        Payload::Empty => return None,
    };
    let Some(route) = model.as_deref().and_then(|m| routes.get(m)) else {
        return Some(Named {
            model: model.map(Cow::into_owned),
            route: None,
        });
    };
    // An empty value names no one: drawn at random, as without the header.
    let key = (route.sticky_header.as_ref())
        .and_then(|h| req.headers().get(h))
        .map(|v| v.as_bytes())
        .filter(|k| !k.is_empty());
    let target = route.choose(key, &mut rand::rng());
    let spliced = match payload {
        // A model name is a JSON string however it is written: quoted and escaped.
        Payload::Json => splice(body, at, json_string(&target.model).as_bytes()),
        _ => splice(body, at, target.model.as_bytes()),
    };
    tracing::debug!(route = %route.name, target = %target.model, "model route");
    let named = Named {
        model: Some(target.model.to_string()),
        route: Some(route.name.clone()),
    };
    (req.headers_mut()).insert(header::CONTENT_LENGTH, spliced.len().into());
    *req.body_mut() = RequestBody::Full(spliced);
    Some(named)
}

/// The JSON body's `model` (its last occurrence, as `scan::json_member` reads it) and where its
/// value is; a `null` or absent model is none.
fn json_model(body: &[u8]) -> Option<(Option<Cow<'_, str>>, Range<usize>)> {
    let Some(raw) = scan::json_member_raw(body, &["model"]).ok()? else {
        return Some((None, 0..0));
    };
    let name = match raw {
        b"null" => return Some((None, 0..0)),
        [b'"', inner @ .., b'"'] if !inner.contains(&b'\\') => {
            Cow::Borrowed(std::str::from_utf8(inner).ok()?)
        }
        [b'"', ..] => Cow::Owned(serde_json::from_slice::<String>(raw).ok()?),
        _ => return None,
    };
    Some((Some(name), within(body, raw)?))
}

/// A multipart form's `model` field and where its value is.
fn form_model<'a>(
    headers: &HeaderMap,
    body: &'a [u8],
) -> Option<(Option<Cow<'a, str>>, Range<usize>)> {
    let content_type = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    let boundary = scan::boundary(content_type)?;
    match scan::form_field(body, boundary, "model") {
        None => Some((None, 0..0)),
        Some(Cow::Borrowed(v)) => Some((Some(Cow::Borrowed(v)), within(body, v.as_bytes())?)),
        // The scan borrows every value it finds; one it had to build has no place to splice.
        Some(Cow::Owned(_)) => None,
    }
}

/// Where `part`, a slice of `body`, lies in it.
fn within(body: &[u8], part: &[u8]) -> Option<Range<usize>> {
    let start = (part.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
    let end = start + part.len();
    (end <= body.len()).then_some(start..end)
}

fn json_string(s: &str) -> String {
    // A `str` always serializes.
    serde_json::to_string(s).unwrap_or_default()
}

/// `body` with the bytes `at` replaced by `value`.
fn splice(body: &[u8], at: Range<usize>, value: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(body.len() - at.len() + value.len());
    out.extend_from_slice(&body[..at.start]);
    out.extend_from_slice(value);
    out.extend_from_slice(&body[at.end..]);
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model_routes::Route;

    fn routes() -> Routes {
        Routes::new(vec![
            Route::new("chat", vec![("llama \"8b\"".into(), 1)], None),
            Route::new(
                "sticky",
                vec![("a".into(), 1), ("b".into(), 1), ("c".into(), 1)],
                Some(http::HeaderName::from_static("x-tenant")),
            ),
        ])
    }

    fn request(body: &str, headers: &[(&str, &str)]) -> Request<RequestBody> {
        let mut req = Request::post("/v1/chat/completions");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.body(RequestBody::Full(Bytes::from(body.to_string())))
            .unwrap()
    }

    fn body(req: &Request<RequestBody>) -> &[u8] {
        match req.body() {
            RequestBody::Full(b) => b,
            RequestBody::Stream(_) => panic!("streamed"),
        }
    }

    #[test]
    fn only_the_model_value_changes() {
        let text = r#"{"model" : "x", "messages":[{"role":"user","content":"a \"q\" \u00e9"}], "model":"chat","n":1}"#;
        let mut req = request(text, &[]);
        let named = apply(&mut req, Payload::Json, &routes()).unwrap();
        assert_eq!(named.model.as_deref(), Some("llama \"8b\""));
        assert_eq!(named.route.as_deref(), Some("chat"));
        let want = text.replace(r#""model":"chat""#, r#""model":"llama \"8b\"""#);
        assert_eq!(body(&req), want.as_bytes());
        assert_eq!(
            req.headers()[header::CONTENT_LENGTH],
            want.len().to_string()
        );
    }

    #[test]
    fn a_model_that_names_no_route_is_handed_on_and_the_body_kept() {
        let routes = routes();
        for (text, model) in [
            (r#"{"model":"other"}"#, Some("other")),
            (r#"{"model":"ch\u0061t2"}"#, Some("chat2")),
            (r#"{"prompt":"x"}"#, None),
            (r#"{"model":null}"#, None),
        ] {
            let mut req = request(text, &[]);
            let named = apply(&mut req, Payload::Json, &routes).unwrap();
            assert_eq!((named.model.as_deref(), named.route), (model, None));
            assert_eq!(body(&req), text.as_bytes());
        }
        // An escaped route name is still the route.
        let mut req = request(r#"{"model":"ch\u0061t"}"#, &[]);
        let named = apply(&mut req, Payload::Json, &routes).unwrap();
        assert_eq!(body(&req), br#"{"model":"llama \"8b\""}"#);
        assert_eq!(named.route.as_deref(), Some("chat"));
        // What select must read and refuse itself.
        for text in [r#"{"model":3}"#, "[1]", "{"] {
            assert_eq!(apply(&mut request(text, &[]), Payload::Json, &routes), None);
        }
    }

    #[test]
    fn a_sticky_key_keeps_its_target() {
        let routes = routes();
        let target = |tenant: &str| {
            let mut req = request(r#"{"model":"sticky"}"#, &[("x-tenant", tenant)]);
            apply(&mut req, Payload::Json, &routes)
                .unwrap()
                .model
                .unwrap()
        };
        for tenant in ["t1", "t2", "t3"] {
            let first = target(tenant);
            assert!((0..20).all(|_| target(tenant) == first), "{tenant} moved");
        }
    }

    #[test]
    fn a_form_field_is_spliced_too() {
        let b = "XyZ";
        let text = format!(
            "--{b}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nchat\r\n--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--{b}--\r\n"
        );
        let ct = format!("multipart/form-data; boundary={b}");
        let mut req = request(&text, &[("content-type", &ct)]);
        let named = apply(&mut req, Payload::Form, &routes()).unwrap();
        assert_eq!(named.model.as_deref(), Some("llama \"8b\""));
        let want = text.replace("\r\n\r\nchat\r\n", "\r\n\r\nllama \"8b\"\r\n");
        assert_eq!(body(&req), want.as_bytes());
        // Without a boundary: select's to refuse.
        let mut req = request(&text, &[("content-type", "multipart/form-data")]);
        assert_eq!(apply(&mut req, Payload::Form, &routes()), None);
    }

    #[test]
    fn a_target_no_engine_serves_is_said_as_the_route() {
        let named = Named {
            model: Some("new".into()),
            route: Some("chat".into()),
        };
        let e = named.explain(
            ModelError::NotFound {
                model: "new".into(),
                served: vec!["old".into()],
            }
            .into(),
        );
        assert_eq!(e.status(), 404);
        assert_eq!(
            e.to_string(),
            "the model `chat` is a route to `new`, which this fleet does not serve; it serves: old"
        );
    }
}
