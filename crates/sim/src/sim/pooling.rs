//! Answers that need no decoding: the pooling family (embeddings, pooling, classification,
//! scoring, reranking, SGLang's `/encode`), vLLM's audio APIs, and the tokenizer endpoints.
//!
//! Their semantics are not simulated, only their cost and their shape: a pooling request holds
//! its prompt's KV on its rank for the moment it is admitted (so it counts toward `served` and
//! `die_after`), then gets plausible numbers in the engine's real top-level shape with the model
//! echoed where the engine echoes it. The tokenizer endpoints run in the engine's API server and
//! never reach a rank's KV, so they admit nothing.

use std::sync::atomic::Ordering::Relaxed;

use http::{Response, StatusCode};
use serde_json::{json, Value};

use super::routes::Pooled;
use super::serve::Call;
use super::{Sim, SimBody, SimFlavor};
use rankgate::http::json_response;

/// The vector every embedding-like answer carries.
const VECTOR: [f64; 4] = [0.1, 0.2, 0.3, 0.4];

impl Sim {
    /// Admits the prompt on the call's rank and answers in the endpoint's shape.
    pub(super) async fn pool(&self, kind: Pooled, call: Call) -> Response<SimBody> {
        let prompt = call.prompt_tokens();
        {
            let _adm = self.ranks[call.local].admit(prompt, 0).await;
            self.admitted();
        }
        let usage = json!({"prompt_tokens": prompt, "total_tokens": prompt});
        let n = self.next_id.fetch_add(1, Relaxed);
        let model = &call.model;
        let items = call.items();
        let body = match kind {
            Pooled::Embedding => json!({"object": "list", "model": model,
                "data": [{"object": "embedding", "index": 0, "embedding": VECTOR}],
                "usage": usage}),
            Pooled::Pooling => json!({"id": format!("pool-sim{n}"), "object": "list",
                "created": 0, "model": model,
                "data": [{"index": 0, "object": "pooling", "data": VECTOR}], "usage": usage}),
            Pooled::Classify => json!({"id": format!("classify-sim{n}"), "object": "list",
                "created": 0, "model": model,
                "data": [{"index": 0, "label": "LABEL_0", "probs": [0.9, 0.1], "num_classes": 2}],
                "usage": usage}),
            Pooled::Score => {
                let data: Vec<Value> = (0..items)
                    .map(|i| json!({"index": i, "object": "score", "score": score(i)}))
                    .collect();
                json!({"id": format!("score-sim{n}"), "object": "list", "created": 0,
                    "model": model, "data": data, "usage": usage})
            }
            Pooled::Rerank => {
                let results: Vec<Value> = (0..items)
                    .map(|i| {
                        let doc = call.document(i);
                        json!({"index": i, "document": {"text": doc}, "relevance_score": score(i)})
                    })
                    .collect();
                json!({"id": format!("rerank-sim{n}"), "model": model,
                    "usage": {"total_tokens": prompt}, "results": results})
            }
            Pooled::Transcription => json!({"text": "t0 t1 t2 ",
                "usage": {"type": "duration", "seconds": 1}}),
            Pooled::Encode => json!({"embedding": VECTOR, "meta_info": {"id": format!("sim{n}"),
                "prompt_tokens": prompt, "finish_reason": null}}),
            Pooled::SglScore => {
                let scores: Vec<Value> = (0..items)
                    .map(|i| json!([score(i), 1.0 - score(i)]))
                    .collect();
                json!({"scores": scores, "model": model, "usage": usage, "object": "scoring"})
            }
            // SGLang answers a bare list, best first, with no model.
            Pooled::SglRerank => Value::Array(
                (0..items)
                    .map(|i| {
                        json!({"score": score(i), "document": call.document(i), "index": i,
                            "meta_info": {"id": format!("sim{n}-{i}"), "prompt_tokens": prompt}})
                    })
                    .collect(),
            ),
        };
        json_response(StatusCode::OK, &body)
    }

    /// `/tokenize`: one made-up token id per token of the prompt.
    pub(super) fn tokenize(&self, call: &Call) -> Response<SimBody> {
        let count = call.prompt_tokens();
        let tokens: Vec<u64> = (0..count).map(|i| 1000 + i).collect();
        let mut body = json!({"count": count, "max_model_len": self.cfg.capacity_tokens,
            "tokens": tokens});
        if self.cfg.flavor == SimFlavor::Vllm {
            body["token_strs"] = Value::Null;
        }
        json_response(StatusCode::OK, &body)
    }

    /// `/detokenize`: the made-up text of each token id, as decoding writes it.
    pub(super) fn detokenize(&self, call: &Call) -> Response<SimBody> {
        let prompt: String = call
            .body
            .get("tokens")
            .and_then(Value::as_array)
            .map(|t| {
                t.iter()
                    .map(|id| format!("t{} ", id.as_u64().unwrap_or(0) % 10))
                    .collect()
            })
            .unwrap_or_default();
        json_response(StatusCode::OK, &json!({"prompt": prompt}))
    }
}

/// A score for the `i`th item that falls with `i`, so results come out best first.
fn score(i: usize) -> f64 {
    0.9 / (1.0 + i as f64)
}

impl Call {
    /// How many items a score or rerank request ranks: its documents (rerank), its second texts
    /// (vLLM score) or its items (SGLang score); one when it names no list.
    fn items(&self) -> usize {
        ["documents", "text_2", "items"]
            .iter()
            .find_map(|k| self.body.get(*k))
            .map_or(1, |v| v.as_array().map_or(1, Vec::len))
    }

    /// The `i`th document of a rerank request, as text.
    fn document(&self, i: usize) -> Value {
        match self.body.get("documents").and_then(|d| d.get(i)) {
            Some(Value::String(s)) => json!(s),
            Some(other) => other.get("text").cloned().unwrap_or(Value::Null),
            None => Value::Null,
        }
    }
}
