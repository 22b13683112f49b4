//! Runtime adapter updates, as vLLM serves them with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`:
//! `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"?}` and
//! `POST /v1/unload_lora_adapter {"lora_name"}` (`vllm/entrypoints/serve/lora/api_router.py`,
//! the checks of `OpenAIServingModels` in `vllm/entrypoints/openai/models/serving.py`). Without
//! it the routes do not exist: the engine answers 404 as for any unknown path.
//!
//! The answers, as captured from vLLM 0.32 (`tests/fixtures/vllm-0.32-lora/`): success is a 200
//! with no content type and a plain-text body (`Success: LoRA adapter 'x' added successfully.`);
//! a field missing is FastAPI's validation error (400, type `Bad Request`, `param` the field's
//! location); an empty name or path, or a name already loaded without `load_inplace`, is a 400
//! `InvalidUserInput`; no adapter at the path is a 404 `NotFoundError` (`Loading lora x failed:
//! No adapter found for p`), as is unloading one not loaded. Past the sim's bounds (how many
//! adapters, how long a name) a load is a 400 `InvalidUserInput` saying which. A load takes the
//! slot load's time (`--lora-load-ms`) before it answers, as vLLM reads the weights first.

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::{json, Map, Value};

use super::super::{lock, Sim, SimBody};
use super::config::{self, MAX_ADAPTERS};
use rankgate::http::json_response;

/// The load route.
pub(crate) const LOAD: &str = "/v1/load_lora_adapter";
/// The unload route.
pub(crate) const UNLOAD: &str = "/v1/unload_lora_adapter";
/// A load or unload request's body at most: a name and a path.
const MAX_BODY_BYTES: usize = 64 * 1024;

impl Sim {
    /// Whether `path` is a runtime update route this engine serves.
    pub(crate) fn lora_route(&self, path: &str) -> bool {
        self.lora.as_ref().is_some_and(|l| l.cfg.runtime_updating)
            && (path == LOAD || path == UNLOAD)
    }

    /// Answers a load or unload request.
    pub(crate) async fn lora_update(
        &self,
        path: &str,
        req: Request<Incoming>,
    ) -> Response<SimBody> {
        let Some(lora) = &self.lora else {
            return failure(
                StatusCode::NOT_FOUND,
                "NotFoundError",
                &format!("no route {path}"),
            );
        };
        let body = match Limited::new(req.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
        {
            Ok(b) => b.to_bytes(),
            Err(e) => return invalid(&format!("reading body: {e}"), None),
        };
        let fields = match serde_json::from_slice::<Value>(&body) {
            Ok(Value::Object(m)) => m,
            Ok(_) => return invalid("the body must be a JSON object", None),
            Err(e) => return invalid(&format!("invalid JSON: {e}"), None),
        };
        let load = path == LOAD;
        if load {
            lora.load_requests
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let names: &[&str] = if load {
            &["lora_name", "lora_path"]
        } else {
            &["lora_name"]
        };
        let text = match strings(&fields, names) {
            Ok(t) => t,
            Err((msg, param)) => return invalid(&msg, Some(&param)),
        };
        let name = text[0].as_str();
        if !load {
            if name.is_empty() {
                return user_error("'lora_name' needs to be provided to unload a LoRA adapter.");
            }
            let mut served = lock(&lora.served);
            let Some(i) = served.iter().position(|s| *s.adapter.name == *name) else {
                let msg = format!("The lora adapter '{name}' cannot be found.");
                return failure(StatusCode::NOT_FOUND, "NotFoundError", &msg);
            };
            served.remove(i);
            return success(format!(
                "Success: LoRA adapter '{name}' removed successfully."
            ));
        }
        let lora_path = text[1].as_str();
        if name.is_empty() || lora_path.is_empty() {
            return user_error("Both 'lora_name' and 'lora_path' must be provided.");
        }
        let in_place = fields
            .get("load_inplace")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let known = lora.find(name).is_some();
        if known && !in_place {
            return user_error(&format!(
                "The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
            ));
        }
        if let Err(e) = config::check_name(name).and_then(|()| config::check_path(lora_path)) {
            return user_error(&format!("rankgate-sim: {e}"));
        }
        if !known && lock(&lora.served).len() >= MAX_ADAPTERS {
            return user_error(&format!(
                "rankgate-sim serves at most {MAX_ADAPTERS} adapters: unload one first"
            ));
        }
        if !config::found(lora_path) {
            let msg = config::not_found(name, lora_path);
            return failure(StatusCode::NOT_FOUND, "NotFoundError", &msg);
        }
        // vLLM reads the adapter's weights before it answers: a load costs what a slot load
        // does.
        tokio::time::sleep(lora.cfg.load_delay).await;
        lora.add(name, lora_path, None, in_place);
        success(format!(
            "Success: LoRA adapter '{name}' added successfully."
        ))
    }
}

/// The string fields `names` of the body, or FastAPI's validation error (its message and
/// `param`) for those missing or not strings.
fn strings(fields: &Map<String, Value>, names: &[&str]) -> Result<Vec<String>, (String, String)> {
    let mut out = Vec::new();
    let mut errors = Vec::new();
    let input = format!("'<dict of {} items>'", fields.len());
    for n in names {
        match fields.get(*n) {
            Some(Value::String(s)) => out.push(s.clone()),
            None => errors.push((n, format!("{{'type': 'missing', 'loc': 'body.{n}', 'msg': 'Field required', 'input': {input}}}"))),
            Some(v) => errors.push((n, format!("{{'type': 'string_type', 'loc': 'body.{n}', 'msg': 'Input should be a valid string', 'input': {v}}}"))),
        }
    }
    let Some((first, _)) = errors.first() else {
        return Ok(out);
    };
    let param = format!("body.{first}");
    let plural = if errors.len() == 1 { "" } else { "s" };
    let lines: Vec<String> = errors.iter().map(|(_, e)| format!("\n  {e}")).collect();
    let msg = format!(
        "{} validation error{plural}:{}",
        errors.len(),
        lines.concat()
    );
    Err((msg, param))
}

/// vLLM's 200: plain text, no content type.
fn success(text: String) -> Response<SimBody> {
    Response::new(SimBody::from(Bytes::from(text)))
}

/// FastAPI's 400 for a body that does not validate.
fn invalid(msg: &str, param: Option<&str>) -> Response<SimBody> {
    let body =
        json!({"error": {"message": msg, "type": "Bad Request", "param": param, "code": 400}});
    json_response(StatusCode::BAD_REQUEST, &body)
}

/// `OpenAIServingModels`' 400 for a request it refuses.
fn user_error(msg: &str) -> Response<SimBody> {
    failure(StatusCode::BAD_REQUEST, "InvalidUserInput", msg)
}

/// vLLM's error shape with no `param`.
fn failure(status: StatusCode, kind: &str, msg: &str) -> Response<SimBody> {
    let body =
        json!({"error": {"message": msg, "type": kind, "param": null, "code": status.as_u16()}});
    json_response(status, &body)
}
