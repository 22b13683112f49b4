//! The simulated engine's HTTP surface: the API key check, the GET endpoints, and the prelude
//! every proxied request goes through (fault knobs, rank pinning as the real engines do it, the
//! record of what was seen, the model check) before `generate` decodes it, `pooling` answers
//! it, or the tokenizer does. `routes` says which path is which.

use std::borrow::Cow;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::faults::Open;
use super::lora::Adapter;
use super::routes::{self, Endpoint};
use super::{auth, multipart};
use super::{lock, read, Seen, Sim, SimFlavor, MAX_REQUEST_BYTES, SEEN_CAP};
use rankgate::http::{json_response, openai_error, respond};
use rankgate::worker::RankNumbering;

/// Response body of the simulated engine: whole, or SSE chunks as the generator sends them.
pub enum SimBody {
    Full(Option<Bytes>),
    Stream(mpsc::Receiver<Bytes>),
}

impl From<Bytes> for SimBody {
    fn from(b: Bytes) -> Self {
        SimBody::Full(Some(b))
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            SimBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            SimBody::Stream(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            SimBody::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            SimBody::Stream(_) => SizeHint::default(),
        }
    }
}

/// SGLang's path for one model card, the id following.
const MODEL_BY_ID: &str = "/v1/models/";

impl Sim {
    pub(super) async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
    ) -> Result<Response<SimBody>, Infallible> {
        let path = req.uri().path().to_string();
        if let Some(key) = &self.cfg.api_key {
            let flavor = self.cfg.flavor;
            if auth::guarded(flavor, req.method(), &path)
                && !auth::accepted(flavor, req.headers(), key)
            {
                return Ok(respond(
                    StatusCode::UNAUTHORIZED,
                    "application/json",
                    auth::UNAUTHORIZED,
                ));
            }
        }
        Ok(match (req.method(), path.as_str()) {
            (&Method::GET, "/health") => respond(self.faults.health(), "text/plain", ""),
            (&Method::GET, "/metrics") => {
                self.telemetry_requests.fetch_add(1, Relaxed);
                if self.faults.hang_metrics.load(Relaxed) {
                    return Ok(self.hold().await);
                }
                let delay = read(&self.knobs).metrics_delay;
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                respond(
                    StatusCode::OK,
                    "text/plain; version=0.0.4",
                    self.render_metrics(),
                )
            }
            (&Method::GET, "/v1/models") => {
                if self.faults.hang_models.load(Relaxed) {
                    return Ok(self.hold().await);
                }
                json_response(StatusCode::OK, &self.models())
            }
            // vLLM serves no `/v1/models/{id}`; SGLang does.
            (&Method::GET, p)
                if self.cfg.flavor == SimFlavor::Sglang && p.starts_with(MODEL_BY_ID) =>
            {
                if self.faults.hang_models.load(Relaxed) {
                    return Ok(self.hold().await);
                }
                self.model_by_id(p.strip_prefix(MODEL_BY_ID).unwrap_or(p))
            }
            // vLLM's `/version` (SGLang has no such route): how a router tells the two apart.
            (&Method::GET, "/version") if self.cfg.flavor == SimFlavor::Vllm => json_response(
                StatusCode::OK,
                &serde_json::json!({"version": "0.32.0+sim"}),
            ),
            // `/get_*` are SGLang's older names, kept (deprecated) by newer versions.
            (&Method::GET, "/get_server_info" | "/server_info")
                if self.cfg.flavor == SimFlavor::Sglang =>
            {
                json_response(StatusCode::OK, &self.server_info())
            }
            (&Method::GET, "/get_model_info" | "/model_info")
                if self.cfg.flavor == SimFlavor::Sglang =>
            {
                json_response(StatusCode::OK, &self.model_info())
            }
            // vLLM's list of where each DP rank publishes its KV events.
            (&Method::GET, "/kv_event_sources")
                if self.cfg.flavor == SimFlavor::Vllm && self.cfg.kv_events.is_some() =>
            {
                match &self.cfg.kv_events {
                    Some(kc) => {
                        json_response(StatusCode::OK, &super::kv::sources(kc, &self.kv_publishers))
                    }
                    None => no_route(&path),
                }
            }
            (&Method::GET, "/v1/loads") if self.cfg.flavor == SimFlavor::Sglang => {
                self.telemetry_requests.fetch_add(1, Relaxed);
                if self.faults.hang_metrics.load(Relaxed) {
                    self.hold().await
                } else if self.native_failing() {
                    openai_error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "InternalServerError",
                        "loads unavailable",
                    )
                } else {
                    self.http_loads(req.uri().query())
                }
            }
            (&Method::POST, p) if self.lora_route(p) => self.lora_update(p, req).await,
            (&Method::POST, p) => match routes::route(self.cfg.flavor, p) {
                Some(endpoint) => self.clone().proxied(req, endpoint).await,
                None => no_route(&path),
            },
            _ => no_route(&path),
        })
    }

    /// The model a request names, or the default when it names none, with the LoRA adapter it
    /// is; `Err` with the name when the engine does not serve it. Both flavors refuse with
    /// vLLM's 404: SGLang's own check has varied across versions (none at all, or a 400), and one
    /// answer keeps routing tests simple.
    fn served_model(&self, v: &Value) -> Result<(String, Option<Adapter>), String> {
        match v.get("model") {
            None | Some(Value::Null) => Ok((self.default_model().to_string(), None)),
            Some(Value::String(m)) if self.cfg.models.contains(m) => Ok((m.clone(), None)),
            Some(Value::String(m)) if self.adapter(m).is_some() => Ok((m.clone(), self.adapter(m))),
            Some(other) => Err(other
                .as_str()
                .map_or_else(|| other.to_string(), str::to_string)),
        }
    }

    /// Parses a pin the way the engine would, returning the local rank index.
    fn resolve_rank(
        &self,
        header: Option<&str>,
        body_rank: Option<&Value>,
    ) -> Result<Option<usize>, (StatusCode, String)> {
        let requested: Option<i64> = match self.cfg.flavor {
            // vLLM silently ignores a header that is not an integer.
            SimFlavor::Vllm => header.and_then(|h| h.trim().parse().ok()),
            SimFlavor::Sglang => match body_rank {
                Some(v) => Some(v.as_i64().ok_or((
                    StatusCode::BAD_REQUEST,
                    format!("data_parallel_rank must be an integer, got {v}"),
                ))?),
                None => match header {
                    Some(h) => Some(h.trim().parse().map_err(|_| {
                        (
                            StatusCode::BAD_REQUEST,
                            format!("X-Data-Parallel-Rank {h:?} is not an integer"),
                        )
                    })?),
                    None => None,
                },
            },
        };
        let Some(r) = requested else { return Ok(None) };
        self.local_rank(r)
            .map(Some)
            .map_err(|msg| (StatusCode::BAD_REQUEST, msg))
    }

    /// The local rank index a requested rank names, in the numbering the engine validates
    /// against; out of range is an error naming the rank and the valid range.
    pub(super) fn local_rank(&self, r: i64) -> Result<usize, String> {
        let base = match self.cfg.rank_numbering {
            RankNumbering::Global => self.cfg.start_rank as i64,
            RankNumbering::Local => 0,
        };
        let local = r - base;
        if local < 0 || local >= self.cfg.dp_size as i64 {
            return Err(format!(
                "data_parallel_rank {r} is out of range [{base}, {}).",
                base + self.cfg.dp_size as i64
            ));
        }
        Ok(local as usize)
    }

    /// The engine's own balancing for unpinned requests: the rank with least KV reserved.
    pub(super) fn least_loaded(&self) -> usize {
        (0..self.ranks.len())
            .min_by_key(|&i| {
                let r = &self.ranks[i];
                r.preload + r.counts().reserved
            })
            .unwrap_or(0)
    }

    /// A request a router proxies to a rank: fault knobs first, then the pin resolved as the
    /// engine would, what was seen recorded, the model checked, and the answer marked with the
    /// rank that served it ([`super::SIM_RANK_HEADER`]).
    async fn proxied(
        self: Arc<Self>,
        req: Request<Incoming>,
        endpoint: Endpoint,
    ) -> Response<SimBody> {
        self.faults.received.fetch_add(1, Relaxed);
        let open = Open::new(&self);
        let head = Head::of(&req);
        let body = match Limited::new(req.into_body(), MAX_REQUEST_BYTES)
            .collect()
            .await
        {
            Ok(b) => b.to_bytes(),
            Err(e) => return bad_request(&format!("reading body: {e}")),
        };
        // Faults come before parsing, as an overloaded or wedged engine answers (or not)
        // whatever the request says; the body is read first so the connection stays usable.
        if let Some(resp) = self.injected_failure() {
            return resp;
        }
        if self.faults.hang_requests.load(Relaxed) {
            return self.hold().await;
        }
        let v = match parse_body(endpoint, head.content_type.as_deref(), &body) {
            Ok(v) => v,
            Err(msg) => return bad_request(&msg),
        };
        // `null` is how an SGLang client leaves the optional field unset.
        let body_rank = ["data_parallel_rank", "routed_dp_rank"]
            .iter()
            .find_map(|k| v.get(*k).filter(|r| !r.is_null()))
            .cloned();
        let pd = match endpoint {
            Endpoint::Decode(api) => match self.pd_leg(api, &v) {
                Ok(leg) => leg,
                Err((field, msg)) => {
                    let bad = StatusCode::BAD_REQUEST;
                    return error(endpoint, bad, "BadRequestError", Some(&field), &msg);
                }
            },
            _ => None,
        };
        // An SGLang room lands on `room % dp_size` unless the request pins a rank.
        let room_rank = pd.as_ref().and_then(|l| l.room_rank(self.cfg.dp_size));
        let local = match self.resolve_rank(head.rank_header.as_deref(), body_rank.as_ref()) {
            Ok(pinned) => pinned.or(room_rank).unwrap_or_else(|| self.least_loaded()),
            Err((status, msg)) => return error(endpoint, status, "BadRequestError", None, &msg),
        };
        let global = self.ranks[local].global;
        self.record(head.seen(&v, body_rank, global));
        // After recording: a test sees what reached the engine even when it is refused.
        let model = if endpoint.checks_model() {
            self.served_model(&v)
        } else {
            Ok((self.default_model().to_string(), None))
        };
        let mut resp = match model {
            Ok((model, adapter)) => {
                let call = Call {
                    local,
                    body: v,
                    model,
                    adapter,
                    open,
                    pd,
                    request_id: head.request_id.clone(),
                };
                match endpoint {
                    Endpoint::Decode(api) => self.clone().decode(api, call).await,
                    Endpoint::Pool(kind) => self.pool(kind, call).await,
                    Endpoint::Tokenize => self.tokenize(&call),
                    Endpoint::Detokenize => self.detokenize(&call),
                }
            }
            Err(name) => error(
                endpoint,
                StatusCode::NOT_FOUND,
                "NotFoundError",
                Some("model"),
                &self.unknown_model(&name),
            ),
        };
        resp.headers_mut()
            .insert(super::SIM_RANK_HEADER, HeaderValue::from(global));
        resp
    }

    fn record(&self, s: Seen) {
        let mut seen = lock(&self.seen);
        if seen.len() == SEEN_CAP {
            seen.pop_front();
        }
        seen.push_back(s);
    }
}

/// What the engine reads off a proxied request's head before taking its body.
struct Head {
    method: Method,
    path: String,
    rank_header: Option<String>,
    authorization: Option<String>,
    request_id: Option<String>,
    forwarded_for: Option<String>,
    traceparent: Option<String>,
    content_type: Option<String>,
    header_names: Vec<String>,
    peer: Option<std::net::SocketAddr>,
}

impl Head {
    fn of(req: &Request<Incoming>) -> Head {
        let h = req.headers();
        let text = |name: &str| {
            h.get(name)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        };
        Head {
            method: req.method().clone(),
            path: req.uri().path().to_string(),
            rank_header: text("x-data-parallel-rank"),
            authorization: text("authorization"),
            request_id: text("x-request-id"),
            forwarded_for: text("x-forwarded-for"),
            traceparent: text("traceparent"),
            content_type: text("content-type"),
            header_names: h.keys().map(|k| k.as_str().to_string()).collect(),
            peer: req.extensions().get::<super::net::Peer>().map(|p| p.0),
        }
    }

    fn seen(&self, body: &Value, body_rank: Option<Value>, rank: u32) -> Seen {
        Seen {
            method: self.method.clone(),
            path: self.path.clone(),
            rank_header: self.rank_header.clone(),
            body_rank,
            rank,
            model: body
                .get("model")
                .map(|m| m.as_str().map_or_else(|| m.to_string(), str::to_string)),
            authorization: self.authorization.clone(),
            request_id: self.request_id.clone(),
            forwarded_for: self.forwarded_for.clone(),
            traceparent: self.traceparent.clone(),
            header_names: self.header_names.clone(),
            peer: self.peer,
        }
    }
}

fn no_route(path: &str) -> Response<SimBody> {
    openai_error(
        StatusCode::NOT_FOUND,
        "NotFoundError",
        &format!("no route {path}"),
    )
}

fn bad_request(msg: &str) -> Response<SimBody> {
    openai_error(StatusCode::BAD_REQUEST, "BadRequestError", msg)
}

/// A proxied request past the prelude: the local rank that serves it, its body (a form's fields
/// for a multipart request), and the served model it names (the default when it names none).
pub(super) struct Call {
    pub(super) local: usize,
    pub(super) body: Value,
    pub(super) model: String,
    /// The LoRA adapter that model is, if it is one ([`super::lora`]).
    pub(super) adapter: Option<Adapter>,
    /// Counts the request as open until the answer, stream included, is done.
    pub(super) open: Open,
    /// What a role server is asked to do with the request's KV ([`super::pd`]).
    pub(super) pd: Option<super::pd::Leg>,
    /// The `x-request-id` header, which a vLLM role server names its answer by.
    pub(super) request_id: Option<String>,
}

impl Call {
    /// The prompt's text: the first prompt-bearing field present, a string as it is, anything
    /// else (chat `messages` included) as its JSON text.
    pub(super) fn prompt_text(&self) -> Cow<'_, str> {
        let v = &self.body;
        if let Some(m) = v.get("messages") {
            return Cow::Owned(m.to_string());
        }
        match ["prompt", "input", "text", "query"]
            .iter()
            .find_map(|k| v.get(*k))
        {
            Some(Value::String(s)) => Cow::Borrowed(s.as_str()),
            Some(p) => Cow::Owned(p.to_string()),
            None => Cow::Borrowed(""),
        }
    }

    /// The prompt's length in tokens, at about four characters per token as for English text
    /// ([`super::prefix::TOKEN_BYTES`]), from [`Call::prompt_text`]; at least one.
    pub(super) fn prompt_tokens(&self) -> u64 {
        (self.prompt_text().len() / super::prefix::TOKEN_BYTES).max(1) as u64
    }
}

/// The body as JSON; a multipart form as the object of its fields, which must hold the upload.
fn parse_body(
    endpoint: Endpoint,
    content_type: Option<&str>,
    body: &[u8],
) -> Result<Value, String> {
    if !endpoint.is_form() {
        return serde_json::from_slice(body).map_err(|e| format!("invalid JSON: {e}"));
    }
    let fields = multipart::fields(content_type.unwrap_or(""), body).map_err(|e| e.to_string())?;
    if !fields.contains_key("file") {
        return Err("the form has no `file` part".into());
    }
    Ok(Value::Object(fields))
}

/// An error as the endpoint answers it: vLLM's OpenAI shape (`param` names the field at fault,
/// `code` is the status), or Anthropic's for the Messages API, whose router translates it.
pub(super) fn error(
    endpoint: Endpoint,
    status: StatusCode,
    kind: &str,
    param: Option<&str>,
    message: &str,
) -> Response<SimBody> {
    let body = if endpoint.anthropic_errors() {
        json!({"type": "error", "error": {"type": kind, "message": message}})
    } else {
        json!({"error": {"message": message, "type": kind, "param": param, "code": status.as_u16()}})
    };
    json_response(status, &body)
}
