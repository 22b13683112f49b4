//! Decoding: a generation request holds KV on its rank while tokens come out at the decode rate,
//! whole or streamed. The five generation APIs share that one loop and differ only in the fields
//! that bound the output and in how the text is framed, which [`Job`] owns:
//!
//! - chat and completions: bounded by `max_completion_tokens`, else `max_tokens` (default 16);
//!   stream `data:` chunks, a usage chunk and `data: [DONE]`.
//! - Responses: `max_output_tokens` (16); events `response.created`, one
//!   `response.output_text.delta` per token, `response.completed` with the whole response.
//! - Anthropic Messages: `max_tokens` (16); `message_start`, `content_block_start`, one
//!   `content_block_delta` per token, `content_block_stop`, `message_delta`, `message_stop`.
//! - SGLang `/generate`: `sampling_params.max_new_tokens` (128); `data:` lines carrying the text
//!   so far and `meta_info`, then `data: [DONE]`.
//!
//! OpenAI documents `max_completion_tokens` as the newer name of `max_tokens`, winning when both
//! are given. The simulated engine always decodes exactly the bound, so `usage` reports it.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::lora::Adapter;
use super::pd::Leg;
use super::prefix::{Blocks, TOKEN_BYTES};
use super::routes::{Api, Endpoint};
use super::serve::{error, Call};
use super::{Sim, SimBody, SimFlavor};
use rankgate::http::json_response;

/// What a generation request asks for, and how its answer is framed.
pub(super) struct Job {
    api: Api,
    stream: bool,
    prompt_tokens: u64,
    /// The prompt's KV blocks, with prefix caching on.
    blocks: Option<Blocks>,
    /// The prompt's token ids when the engine's tokenizer gave them (else the sim counts four
    /// bytes a token).
    prompt_ids: Option<Vec<u32>>,
    /// What the conversation's next request will start with, with prefix caching on: the chat
    /// `messages`, or the completion `prompt` text.
    history: Option<History>,
    max_tokens: u64,
    /// The response id (`chatcmpl-sim3`, `resp_sim3`, ...).
    id: String,
    /// The served model the request named, echoed in the response.
    model: String,
    /// What a role server does with the request's KV ([`super::pd`]).
    pd: Option<Leg>,
    /// A vLLM role server's whole answers carry `kv_transfer_params` (null but on P's).
    transfer_params: bool,
    /// Its place in the rank's queue under the priority policy ([`super::queue`]); 0 else.
    priority: i64,
    /// The LoRA adapter it runs ([`super::lora`]), which takes a slot and writes its own text.
    adapter: Option<Adapter>,
}

impl Job {
    fn new(sim: &Sim, api: Api, call: &Call, n: u64) -> Job {
        let v = &call.body;
        let field = |k: &str| v.get(k).and_then(Value::as_u64);
        let max_tokens = match api {
            Api::Chat | Api::Completion => field("max_completion_tokens")
                .or_else(|| field("max_tokens"))
                .unwrap_or(16),
            Api::Responses => field("max_output_tokens").unwrap_or(16),
            Api::Messages => field("max_tokens").unwrap_or(16),
            Api::Generate => v
                .pointer("/sampling_params/max_new_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(128),
        };
        // A vLLM role server names its answer by the `x-request-id` it got, as vLLM does, so
        // that both legs of a PD request carry the router's id.
        let vllm_role = sim.cfg.role.is_some() && sim.cfg.flavor == SimFlavor::Vllm;
        let named = call.request_id.as_deref().filter(|_| vllm_role);
        let id = match (api, named) {
            (Api::Chat, Some(rid)) => format!("chatcmpl-{rid}"),
            (Api::Completion, Some(rid)) => format!("cmpl-{rid}"),
            (Api::Chat, None) => format!("chatcmpl-sim{n}"),
            (Api::Completion, None) => format!("cmpl-sim{n}"),
            (Api::Responses, _) => format!("resp_sim{n}"),
            (Api::Messages, _) => format!("msg_sim{n}"),
            (Api::Generate, _) => format!("sim{n}"),
        };
        let tokenized = (sim.cfg.tokenizer.as_ref()).and_then(|t| t.prompt_ids(&call.body));
        let (prompt_tokens, blocks) = match &tokenized {
            Some(ids) => (
                (ids.len() as u64).max(1),
                sim.cfg
                    .prefix_caching
                    .then(|| sim.held(Blocks::of_tokens(ids))),
            ),
            None => {
                let n = call.prompt_tokens();
                (n, sim.prompt_blocks(call.prompt_text().as_bytes(), n))
            }
        };
        let history = match (api, sim.cfg.prefix_caching) {
            (Api::Chat, true) => v.get("messages").cloned().map(History::Messages),
            (Api::Completion, true) => v
                .get("prompt")
                .and_then(Value::as_str)
                .map(|p| History::Prompt(p.to_string())),
            _ => None,
        };
        Job {
            history,
            api,
            stream: v.get("stream").and_then(Value::as_bool).unwrap_or(false),
            prompt_tokens,
            blocks: super::lora::salted(blocks, call.adapter.as_ref()),
            prompt_ids: tokenized,
            max_tokens: match &call.pd {
                Some(leg) if leg.one_token() => 1,
                _ => max_tokens.max(1),
            },
            id,
            model: call.model.clone(),
            pd: call.pd.clone(),
            transfer_params: vllm_role && matches!(api, Api::Chat | Api::Completion),
            priority: 0,
            adapter: call.adapter.clone(),
        }
    }

    /// The text a follow-up request starts with once `answer` is the reply: the messages with the
    /// assistant's message appended (without the array's closing bracket, which the next turn
    /// replaces by its new messages), or the prompt followed by the completion.
    fn continued(&self, answer: &str) -> Option<String> {
        match self.history.as_ref()? {
            History::Messages(m) => {
                let mut m = m.clone();
                m.as_array_mut()?
                    .push(json!({"role": "assistant", "content": answer}));
                let mut text = m.to_string();
                text.pop();
                Some(text)
            }
            History::Prompt(p) => Some(format!("{p}{answer}")),
        }
    }

    /// Events a stream opens with, before any token.
    fn opening(&self) -> Option<Bytes> {
        match self.api {
            Api::Responses => {
                let mut r = self.whole("");
                r["status"] = json!("in_progress");
                r["output"] = json!([]);
                Some(event(
                    "response.created",
                    json!({"type": "response.created", "sequence_number": 0, "response": r}),
                ))
            }
            Api::Messages => {
                let mut m = self.whole("");
                m["content"] = json!([]);
                m["stop_reason"] = Value::Null;
                m["usage"]["output_tokens"] = json!(0);
                let mut b = event(
                    "message_start",
                    json!({"type": "message_start", "message": m}),
                )
                .to_vec();
                b.extend_from_slice(&event(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}}),
                ));
                Some(b.into())
            }
            Api::Chat | Api::Completion | Api::Generate => None,
        }
    }

    /// The event carrying token `i` (`token`), `text` being everything decoded so far.
    fn token(&self, i: u64, token: &str, text: &str) -> Bytes {
        match self.api {
            Api::Chat => self.chunk(json!({"index": 0, "delta": {"content": token},
                "logprobs": null, "finish_reason": null})),
            Api::Completion => self.chunk(json!({"index": 0, "text": token,
                "logprobs": null, "finish_reason": null})),
            Api::Responses => event(
                "response.output_text.delta",
                json!({"type": "response.output_text.delta", "sequence_number": i + 1,
                    "item_id": self.item_id(), "output_index": 0, "content_index": 0,
                    "delta": token}),
            ),
            Api::Messages => event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": token}}),
            ),
            // SGLang streams the whole text so far, the last chunk saying why it finished.
            Api::Generate => data(&json!({"text": text, "meta_info": self.meta_info(i + 1)})),
        }
    }

    /// Events a finished stream ends with.
    fn closing(&self, text: &str) -> Bytes {
        let done = Bytes::from_static(b"data: [DONE]\n\n");
        match self.api {
            Api::Chat | Api::Completion => {
                let object = self.chunk_object();
                let mut b = data(
                    &json!({"id": self.id, "object": object, "model": self.model,
                    "choices": [], "usage": self.usage()}),
                )
                .to_vec();
                b.extend_from_slice(&done);
                b.into()
            }
            Api::Responses => event(
                "response.completed",
                json!({"type": "response.completed", "sequence_number": self.max_tokens + 1,
                    "response": self.whole(text)}),
            ),
            Api::Messages => {
                let mut b = event(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": 0}),
                )
                .to_vec();
                b.extend_from_slice(&event(
                    "message_delta",
                    json!({"type": "message_delta",
                        "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
                        "usage": {"output_tokens": self.max_tokens}}),
                ));
                b.extend_from_slice(&event("message_stop", json!({"type": "message_stop"})));
                b.into()
            }
            Api::Generate => done,
        }
    }

    /// The whole answer of a request that does not stream.
    fn whole(&self, text: &str) -> Value {
        let (p, c) = (self.prompt_tokens, self.max_tokens);
        match self.api {
            Api::Chat => json!({"id": self.id, "object": "chat.completion", "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                    "finish_reason": "length"}],
                "usage": self.usage()}),
            Api::Completion => json!({"id": self.id, "object": "text_completion",
                "model": self.model,
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": self.usage()}),
            Api::Responses => json!({"id": self.id, "object": "response", "created_at": 0,
                "model": self.model, "status": "completed",
                "output": [{"type": "message", "id": self.item_id(), "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
                "usage": {"input_tokens": p, "output_tokens": c, "total_tokens": p + c}}),
            Api::Messages => json!({"id": self.id, "type": "message", "role": "assistant",
                "model": self.model, "content": [{"type": "text", "text": text}],
                "stop_reason": "max_tokens", "stop_sequence": null,
                "usage": {"input_tokens": p, "output_tokens": c}}),
            Api::Generate => json!({"text": text, "meta_info": self.meta_info(c)}),
        }
    }

    fn usage(&self) -> Value {
        let (p, c) = (self.prompt_tokens, self.max_tokens);
        json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
    }

    /// SGLang's per-request report after `done` tokens.
    fn meta_info(&self, done: u64) -> Value {
        let finish = (done >= self.max_tokens).then(|| json!({"type": "length", "length": done}));
        json!({"id": self.id, "finish_reason": finish, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done, "cached_tokens": 0})
    }

    /// The Responses API's output message id.
    fn item_id(&self) -> String {
        format!("msg_{}", self.id)
    }

    fn chunk_object(&self) -> &'static str {
        if self.api == Api::Chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        }
    }

    fn chunk(&self, choice: Value) -> Bytes {
        data(
            &json!({"id": self.id, "object": self.chunk_object(), "model": self.model,
            "choices": [choice]}),
        )
    }
}

/// What a conversation's next request starts with, before the answer.
enum History {
    Messages(Value),
    Prompt(String),
}

/// One SSE `data:` line.
fn data(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// One named SSE event.
fn event(name: &str, v: Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {v}\n\n"))
}

impl Sim {
    /// The blocks a finished generation leaves cached, with prefix caching on. With the
    /// tokenizer's ids: the prompt's tokens followed by the answer's, as vLLM keeps the blocks
    /// of computed tokens. Without: the blocks of the text the conversation's next request
    /// starts with ([`Job::continued`]), chat and completions only.
    fn kept_blocks(&self, job: &Job, answer: &str) -> Option<Blocks> {
        job.blocks.as_ref()?;
        if let (Some(ids), Some(t)) = (&job.prompt_ids, &self.cfg.tokenizer) {
            let mut all = ids.clone();
            all.extend(t.text_ids(answer)?);
            return Some(self.held(Blocks::of_tokens(&all)));
        }
        let next = job.continued(answer)?;
        let tokens = (next.len() / TOKEN_BYTES) as u64;
        Some(self.held(Blocks::of_text(next.as_bytes(), tokens)))
    }

    /// A P's whole answer whose body comes `pd.answer_delay` after its head.
    fn late_body(&self, v: &Value) -> Response<SimBody> {
        let (tx, rx) = mpsc::channel(1);
        let (body, delay) = (Bytes::from(v.to_string()), self.cfg.pd.answer_delay);
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = tx.send(body).await;
        });
        let mut resp = Response::new(SimBody::Stream(rx));
        (resp.headers_mut()).insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        resp
    }

    /// Answers a generation request, streaming or whole.
    pub(super) async fn decode(self: Arc<Self>, api: Api, call: Call) -> Response<SimBody> {
        let priority = match self.priority(api, &call.body) {
            Ok(p) => p,
            Err(msg) => {
                let bad = StatusCode::BAD_REQUEST;
                return error(
                    Endpoint::Decode(api),
                    bad,
                    "BadRequestError",
                    Some("priority"),
                    &msg,
                );
            }
        };
        let n = self.next_id.fetch_add(1, Relaxed);
        let job = Job {
            priority,
            ..Job::new(&self, api, &call, n)
        };
        let local = call.local;
        if !job.stream {
            return match self.run(local, &job, None).await {
                Some(Ok(v))
                    if self.cfg.role == Some(super::PdRole::Prefill)
                        && !self.cfg.pd.answer_delay.is_zero() =>
                {
                    self.late_body(&v)
                }
                Some(Ok(v)) => json_response(StatusCode::OK, &v),
                Some(Err(e)) => json_response(StatusCode::INTERNAL_SERVER_ERROR, &e),
                None => self.hold().await,
            };
        }
        let (tx, rx) = mpsc::channel(16);
        let open = call.open;
        tokio::spawn(async move {
            let _open = open;
            // A client gone while the job still queues or stalls ends it here rather than at
            // its next token, which may never come.
            tokio::select! {
                _ = self.run(local, &job, Some(&tx)) => {}
                _ = tx.closed() => {}
            }
        });
        let mut resp = Response::new(SimBody::Stream(rx));
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        resp
    }

    /// Admits the job on its rank and decodes it. Streaming jobs send their events to `tx` and
    /// stop early (freeing their KV) if the client goes away; others return the whole answer.
    /// `None` when the answer will not come: the client left, or the job stalled and the engine
    /// is shutting down. `Err` is a failed PD leg's error body (500).
    async fn run(
        &self,
        local: usize,
        job: &Job,
        tx: Option<&mpsc::Sender<Bytes>>,
    ) -> Option<Result<Value, Value>> {
        let rank = &self.ranks[local];
        if let (Some(tx), Some(open)) = (tx, job.opening()) {
            tx.send(open).await.ok()?;
        }
        let adapter = job.adapter.as_ref();
        let mut adm = rank
            .admit_adapter(
                job.prompt_tokens,
                job.blocks.as_ref(),
                job.max_tokens,
                job.priority,
                adapter.map(|a| a.id),
            )
            .await;
        self.admitted();
        let _lora = self.lora_running(adapter);
        // A D's prompt KV comes from its P, with its KV allocated here: that prefill is skipped.
        let remote = match (self.pd_before_prefill(local, job.pd.as_ref(), job.prompt_tokens)).await
        {
            Ok(n) => n,
            Err(fail) => return self.pd_failed(fail, tx).await,
        };
        let computed = (job.prompt_tokens).saturating_sub(adm.cached_tokens + remote);
        self.pd_computed(local, computed);
        self.lora_stall(local).await;
        self.prefill(local, computed).await;
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
                super::pause(Duration::from_secs_f64(itl)).await;
                self.decode_step(local).await;
                self.lora_stall(local).await;
            }
            adm.grow();
            let token = super::lora::token(adapter, i);
            text.push_str(&token);
            if let Some(tx) = tx {
                tx.send(job.token(i, &token, &text)).await.ok()?;
            }
        }
        // A stall at or past the last token still withholds the end: no usage, no `[DONE]`.
        if self.faults.stalls_at(job.max_tokens) {
            self.hold().await;
            return None;
        }
        // With the request's KV still held: a P lends it or hands it to its D.
        let leg = job.pd.as_ref();
        let params =
            match (self.pd_after_decode(local, leg, &job.id, job.prompt_tokens, &adm)).await {
                Ok(p) => p,
                Err(fail) => return self.pd_failed(fail, tx).await,
            };
        if let Some(keep) = super::lora::salted(self.kept_blocks(job, &text), adapter) {
            adm.keep_blocks(keep);
        }
        match tx {
            Some(tx) => {
                let _ = tx.send(job.closing(&text)).await;
                None
            }
            None => {
                let mut whole = job.whole(&text);
                if job.transfer_params {
                    whole["kv_transfer_params"] = params.unwrap_or(Value::Null);
                }
                Some(Ok(whole))
            }
        }
    }
}
