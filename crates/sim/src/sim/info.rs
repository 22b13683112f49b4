//! What the engine says about itself: the served models, and SGLang's server and model info,
//! which routers read to learn the DP size and the model path.
//!
//! SGLang's `/server_info` (older `/get_server_info`) is its server arguments merged with the
//! scheduler's info; only the keys a router reads are imitated, and never `api_key`, which the
//! real one lists with the other arguments.

use http::{Response, StatusCode};
use serde_json::{json, Value};

use super::{Sim, SimBody, DEFAULT_MODEL};
use rankgate::http::json_response;

impl Sim {
    /// The first served model: what a request that names none gets, and the `model_name` label
    /// of `/metrics` (vLLM labels its series with the first served name).
    pub(crate) fn default_model(&self) -> &str {
        self.cfg
            .models
            .first()
            .map_or(DEFAULT_MODEL, String::as_str)
    }

    /// `/v1/models`: one card per served name, then one per LoRA adapter.
    pub(super) fn models(&self) -> Value {
        let mut data: Vec<Value> = self.cfg.models.iter().map(|m| self.model_card(m)).collect();
        data.extend(self.adapter_cards());
        json!({"object": "list", "data": data})
    }

    fn model_card(&self, id: &str) -> Value {
        json!({
            "id": id, "object": "model", "created": 0,
            "owned_by": self.cfg.flavor.as_str(), "root": id, "parent": null,
            "max_model_len": self.cfg.capacity_tokens,
        })
    }

    /// SGLang's `/v1/models/{id}`: the card, or its own 404 (not vLLM's shape: a string code).
    pub(super) fn model_by_id(&self, id: &str) -> Response<SimBody> {
        if self.cfg.models.iter().any(|m| m == id) {
            return json_response(StatusCode::OK, &self.model_card(id));
        }
        json_response(
            StatusCode::NOT_FOUND,
            &json!({"error": {"message": format!("The model '{id}' does not exist"),
                "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}),
        )
    }

    /// SGLang's `/server_info`.
    pub(super) fn server_info(&self) -> Value {
        let model = self.default_model();
        let internal: Vec<Value> = self
            .ranks
            .iter()
            .map(|r| json!({"dp_rank": r.global}))
            .collect();
        json!({
            "model_path": model, "tokenizer_path": model, "served_model_name": model,
            "tp_size": 1, "dp_size": self.cfg.deployment_size(), "pp_size": 1,
            "max_total_num_tokens": self.ranks.first().map_or(0, |r| r.capacity),
            "max_req_input_len": self.cfg.capacity_tokens,
            "internal_states": internal, "version": "sim",
        })
    }

    /// SGLang's `/model_info` (older `/get_model_info`).
    pub(super) fn model_info(&self) -> Value {
        let model = self.default_model();
        json!({"model_path": model, "tokenizer_path": model, "is_generation": true,
            "preferred_sampling_params": null, "weight_version": "default"})
    }
}
