//! `rankgate openai-client`: the requests an application using the official `openai` SDK makes
//! first (chat, a streamed chat, the model list, one model, a response, an embedding), sent as
//! the SDK sends them, to rankgate or any OpenAI-compatible server; prints what each got and
//! which rank served it.

use super::ToolResult;
use crate::load::sdk;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Server base URL, without /v1.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub base_url: String,
    #[arg(long, default_value = "tiny-llama")]
    pub model: String,
    /// Sent as `Authorization: Bearer`, as the SDK always does (it needs some key).
    #[arg(long, default_value = "EMPTY")]
    pub api_key: String,
    /// rankgate's admin token (else RANKGATE_ADMIN_TOKEN): each call asks which rank served
    /// it, named whatever `server.expose_worker` says.
    #[arg(long)]
    pub admin_token: Option<String>,
}

/// Sends each call in turn; fails, after all of them, when any failed.
pub async fn run(args: Args) -> ToolResult {
    let client = rankgate::http::client(std::time::Duration::from_secs(2));
    let mut failed = 0;
    let token = super::admin_token(args.admin_token);
    for call in sdk::calls(&args.model) {
        let sent = sdk::send_as(
            &client,
            &args.base_url,
            &args.api_key,
            token.as_deref(),
            &call,
        );
        match sent.await {
            Ok(o) => {
                // Without a worker: rankgate answered itself (the model list), or hides the
                // rank from clients (`expose_worker = "none"`) and was not asked.
                let worker = match (&o.worker, &token) {
                    (Some(w), _) => w.as_str(),
                    (None, Some(_)) => "(none: answered by the router itself)",
                    (None, None) => crate::load::HIDDEN,
                };
                println!(
                    "{:<40} {} worker={} request-id={} {} bytes",
                    call.name,
                    o.status,
                    worker,
                    o.request_id.as_deref().unwrap_or("-"),
                    o.body.len()
                );
                if !o.status.is_success() {
                    // The error's own message (OpenAI shape), else the start of the body.
                    let why = o
                        .json()
                        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
                        .unwrap_or_else(|| {
                            String::from_utf8_lossy(&o.body[..o.body.len().min(200)]).into()
                        });
                    println!("{:<40} {why}", "");
                    failed += 1;
                }
            }
            Err(e) => {
                println!("{:<40} failed: {e}", call.name);
                failed += 1;
            }
        }
    }
    match failed {
        0 => Ok(()),
        n => Err(format!("{n} call(s) failed")),
    }
}
