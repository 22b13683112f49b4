//! The simulated engine's OpenAI API: rank pinning as the real engines do it, admission into a
//! rank's KV, and token streaming at the decode rate, with the request-side fault knobs applied.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::auth;
use super::faults::Open;
use super::{lock, read, Seen, Sim, SimFlavor, MAX_REQUEST_BYTES, SEEN_CAP};
use crate::http::{json_response, openai_error, respond};
use crate::worker::RankNumbering;

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

/// What a generation request asks for.
struct Job {
    chat: bool,
    stream: bool,
    prompt_tokens: u64,
    max_tokens: u64,
    id: u64,
    /// The served model the request named, echoed in the response.
    model: String,
}

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
            (&Method::POST, "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings") => {
                self.clone().proxied(req).await
            }
            _ => openai_error(
                StatusCode::NOT_FOUND,
                "NotFoundError",
                &format!("no route {path}"),
            ),
        })
    }

    fn models(&self) -> Value {
        let data: Vec<Value> = self.cfg.models.iter().map(|m| self.model_card(m)).collect();
        json!({"object": "list", "data": data})
    }

    fn model_card(&self, id: &str) -> Value {
        json!({
            "id": id, "object": "model", "created": 0,
            "owned_by": self.cfg.flavor.as_str(), "root": id, "parent": null,
            "max_model_len": self.cfg.capacity_tokens,
        })
    }

    /// The model a request names, or the default when it names none; `Err` with the name when
    /// the engine does not serve it. Both flavors refuse with vLLM's 404: SGLang's own check has
    /// varied across versions (none at all, or a 400), and one answer keeps routing tests simple.
    fn served_model(&self, v: &Value) -> Result<String, String> {
        match v.get("model") {
            None | Some(Value::Null) => Ok(self.default_model().to_string()),
            Some(Value::String(m)) if self.cfg.models.contains(m) => Ok(m.clone()),
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
        let base = match self.cfg.rank_numbering {
            RankNumbering::Global => self.cfg.start_rank as i64,
            RankNumbering::Local => 0,
        };
        let local = r - base;
        if local < 0 || local >= self.cfg.dp_size as i64 {
            return Err((
                StatusCode::BAD_REQUEST,
                format!(
                    "data_parallel_rank {r} is out of range [{base}, {}).",
                    base + self.cfg.dp_size as i64
                ),
            ));
        }
        Ok(Some(local as usize))
    }

    /// The engine's own balancing for unpinned requests: the rank with least KV reserved.
    fn least_loaded(&self) -> usize {
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
    async fn proxied(self: Arc<Self>, req: Request<Incoming>) -> Response<SimBody> {
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
        let v: Value = match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => return bad_request(&format!("invalid JSON: {e}")),
        };
        let body_rank = v
            .get("data_parallel_rank")
            .or_else(|| v.get("routed_dp_rank"))
            .cloned();
        let local = match self.resolve_rank(head.rank_header.as_deref(), body_rank.as_ref()) {
            Ok(pinned) => pinned.unwrap_or_else(|| self.least_loaded()),
            Err((status, msg)) => return openai_error(status, "BadRequestError", &msg),
        };
        let global = self.ranks[local].global;
        self.record(head.seen(&v, body_rank, global));
        // After recording: a test sees what reached the engine even when it is refused.
        let mut resp = match self.served_model(&v) {
            Ok(model) => {
                self.clone()
                    .generate(&head.path, v, local, model, open)
                    .await
            }
            Err(name) => model_not_found(&name),
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

    async fn generate(
        self: Arc<Self>,
        path: &str,
        v: Value,
        local: usize,
        model: String,
        open: Open,
    ) -> Response<SimBody> {
        let prompt_text_len = match (v.get("messages"), v.get("prompt"), v.get("input")) {
            (Some(m), _, _) => m.to_string().len(),
            (_, Some(p), _) | (_, _, Some(p)) => {
                p.as_str().map_or_else(|| p.to_string().len(), str::len)
            }
            _ => 0,
        };
        let embeddings = path == "/v1/embeddings";
        let job = Job {
            chat: path == "/v1/chat/completions",
            stream: v.get("stream").and_then(Value::as_bool).unwrap_or(false) && !embeddings,
            // About four characters per token, as for English text.
            prompt_tokens: (prompt_text_len as u64 / 4).max(1),
            model,
            max_tokens: if embeddings {
                0
            } else {
                v.get("max_tokens")
                    .and_then(Value::as_u64)
                    .unwrap_or(16)
                    .max(1)
            },
            id: self.next_id.fetch_add(1, Relaxed),
        };
        if job.stream {
            let (tx, rx) = mpsc::channel(16);
            tokio::spawn(async move {
                let _open = open;
                // A client gone while the job still queues or stalls ends it here rather than
                // at its next token, which may never come.
                tokio::select! {
                    _ = self.run(local, job, Some(tx.clone())) => {}
                    _ = tx.closed() => {}
                }
            });
            let mut resp = Response::new(SimBody::Stream(rx));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            );
            resp
        } else if embeddings {
            let _adm = self.ranks[local].admit(job.prompt_tokens, 0).await;
            self.admitted();
            json_response(
                StatusCode::OK,
                &json!({
                    "object": "list", "model": job.model,
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3, 0.4]}],
                    "usage": {"prompt_tokens": job.prompt_tokens, "total_tokens": job.prompt_tokens},
                }),
            )
        } else {
            match self.run(local, job, None).await {
                Some(text) => json_response(StatusCode::OK, &text),
                None => self.hold().await,
            }
        }
    }

    /// Admits the job on its rank and decodes it. Streaming jobs send SSE chunks to `tx` and stop
    /// early (freeing their KV) if the client goes away; others return the whole completion.
    /// `None` when the completion will not come: the client left, or the job stalled and the
    /// engine is shutting down.
    async fn run(&self, local: usize, job: Job, tx: Option<mpsc::Sender<Bytes>>) -> Option<Value> {
        let rank = &self.ranks[local];
        let mut adm = rank.admit(job.prompt_tokens, job.max_tokens).await;
        self.admitted();
        let prefill =
            Duration::from_secs_f64(job.prompt_tokens as f64 / self.cfg.prefill_tokens_per_sec);
        tokio::time::sleep(prefill).await;
        let kind = if job.chat { "chatcmpl" } else { "cmpl" };
        let id = format!("{kind}-sim{}", job.id);
        let mut text = String::new();
        for i in 0..job.max_tokens {
            if self.faults.stalls_at(i) {
                // Holding `adm` keeps the KV taken, as a wedged request does on a real engine.
                self.hold().await;
                return None;
            }
            if i > 0 {
                let running = rank.counts().running.saturating_sub(1) as f64;
                let itl =
                    (1.0 + running * self.cfg.batch_slowdown) / self.cfg.decode_tokens_per_sec;
                tokio::time::sleep(Duration::from_secs_f64(itl)).await;
            }
            adm.grow();
            let token = format!("t{} ", i % 10);
            if let Some(tx) = &tx {
                let delta = if job.chat {
                    json!({"index": 0, "delta": {"content": token}, "logprobs": null, "finish_reason": null})
                } else {
                    json!({"index": 0, "text": token, "logprobs": null, "finish_reason": null})
                };
                if tx
                    .send(chunk(&id, &job.model, job.chat, delta))
                    .await
                    .is_err()
                {
                    return None;
                }
            } else {
                text.push_str(&token);
            }
        }
        // A stall at or past the last token still withholds the end: no usage, no `[DONE]`.
        if self.faults.stalls_at(job.max_tokens) {
            self.hold().await;
            return None;
        }
        let usage = json!({"prompt_tokens": job.prompt_tokens, "completion_tokens": job.max_tokens,
            "total_tokens": job.prompt_tokens + job.max_tokens});
        if let Some(tx) = &tx {
            let mut last = serde_json::Map::new();
            last.insert("id".into(), json!(id));
            last.insert(
                "object".into(),
                json!(if job.chat {
                    "chat.completion.chunk"
                } else {
                    "text_completion"
                }),
            );
            last.insert("model".into(), json!(job.model));
            last.insert("choices".into(), json!([]));
            last.insert("usage".into(), usage);
            let _ = tx
                .send(Bytes::from(format!("data: {}\n\n", Value::Object(last))))
                .await;
            let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
            return None;
        }
        let choice = if job.chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": text, "finish_reason": "length"})
        };
        Some(
            json!({"id": id, "object": if job.chat { "chat.completion" } else { "text_completion" },
            "model": job.model, "choices": [choice], "usage": usage}),
        )
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
        }
    }
}

fn bad_request(msg: &str) -> Response<SimBody> {
    openai_error(StatusCode::BAD_REQUEST, "BadRequestError", msg)
}

/// vLLM's answer to a model it does not serve: the OpenAI error shape with `param` naming the
/// field and `code` the status.
fn model_not_found(name: &str) -> Response<SimBody> {
    let status = StatusCode::NOT_FOUND;
    json_response(
        status,
        &json!({"error": {
            "message": format!("The model `{name}` does not exist."),
            "type": "NotFoundError", "param": "model", "code": status.as_u16(),
        }}),
    )
}

fn chunk(id: &str, model: &str, chat: bool, choice: Value) -> Bytes {
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let v = json!({"id": id, "object": object, "model": model, "choices": [choice]});
    Bytes::from(format!("data: {v}\n\n"))
}
