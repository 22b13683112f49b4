//! `rankgate grpc-client`: a gRPC client for an engine's own service, or for rankgate's gRPC
//! front door, which serves the same services: one streaming `Generate` (the worker that served
//! it is in the response's `x-rankgate-worker` metadata), then the per-rank loads from
//! `GetLoads`. With the admin token it asks rankgate which rank served the call (named under
//! any `server.expose_worker`); `--ca-file` reaches a front door whose certificate a private CA
//! signed.

use std::time::{Duration, Instant};

use rankgate::telemetry::grpc::{transport_with, LoadsClient};
use rankgate::worker::Flavor;

use super::ToolResult;
use crate::load::grpc::{Event, GenerateCall, GrpcClient};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The gRPC address: rankgate's server.grpc_listen, or an engine's.
    #[arg(long, default_value = "http://127.0.0.1:18050")]
    pub url: String,
    #[arg(long, default_value = "vllm")]
    pub flavor: String,
    #[arg(long, default_value_t = 32)]
    pub prompt_tokens: u64,
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    #[arg(long, default_value = "grpc-client-1")]
    pub id: String,
    /// rankgate's admin token (else RANKGATE_ADMIN_TOKEN): the call asks which rank served it.
    #[arg(long)]
    pub admin_token: Option<String>,
    /// PEM CA bundle that signed an `https://` server's certificate (else the system's roots).
    #[arg(long)]
    pub ca_file: Option<std::path::PathBuf>,
}

/// Every call is bounded: a server that never answers ends the example, not hangs it.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// One streaming `Generate`, then `GetLoads`, each bounded by [`CALL_TIMEOUT`].
pub async fn run(a: Args) -> ToolResult {
    let flavor = match a.flavor.as_str() {
        "vllm" => Flavor::Vllm,
        "sglang" => Flavor::Sglang,
        other => return Err(format!("--flavor {other:?}: vllm or sglang")),
    };
    let tls = rankgate::tls::Upstream::trusting(a.ca_file.as_deref())
        .map_err(|e| format!("--ca-file: {e}"))?;
    let transport = transport_with(Duration::from_secs(2), &tls);
    let origin = a.url.trim_end_matches('/');
    let mut client = GrpcClient::with_transport(flavor, origin, transport.clone())?;
    let token = super::admin_token(a.admin_token);
    let call = GenerateCall {
        request_id: a.id.clone(),
        prompt_tokens: a.prompt_tokens,
        max_tokens: a.max_tokens,
        rank: None,
        admin_token: token.as_deref().map(Into::into),
    };
    let started = Instant::now();
    let generation = tokio::time::timeout(CALL_TIMEOUT, async {
        let mut g = client.generate(&call).await?;
        // Without the metadata: an engine answered directly, or rankgate hides its ranks
        // (`expose_worker = "none"`) from a caller without the admin token.
        let unnamed = match &token {
            Some(_) => "(no x-rankgate-worker: not through rankgate)",
            None => "(hidden by the router: give --admin-token; or not through rankgate)",
        };
        println!(
            "Generate {:?}: served by {}",
            a.id,
            g.worker.as_deref().unwrap_or(unnamed)
        );
        let mut first = None;
        while let Some(ev) = g.next().await? {
            match ev {
                Event::Chunk { completion } => {
                    first.get_or_insert(started.elapsed());
                    print!("{completion} ");
                }
                Event::Complete { reason, tokens } => {
                    println!("\ncomplete: {tokens} tokens, finish reason {reason:?}");
                }
            }
        }
        Ok::<_, tonic::Status>(first)
    })
    .await
    .map_err(|_| format!("Generate timed out after {CALL_TIMEOUT:?}"))?;
    match generation {
        Ok(first) => println!(
            "time to first chunk {:.1} ms, whole call {:.1} ms",
            first.unwrap_or_default().as_secs_f64() * 1e3,
            started.elapsed().as_secs_f64() * 1e3
        ),
        Err(s) => return Err(format!("Generate failed: {:?}: {}", s.code(), s.message())),
    }

    let loads = LoadsClient::new(flavor, origin, transport)?;
    let report = tokio::time::timeout(CALL_TIMEOUT, loads.get_loads(None))
        .await
        .map_err(|_| format!("GetLoads timed out after {CALL_TIMEOUT:?}"))??;
    println!("GetLoads: {} ranks", report.dp_rank_count.unwrap_or(0));
    for l in &report.loads {
        println!(
            "  rank {:>3}: KV {:>5.1}%  running {}  waiting {}",
            l.dp_rank.unwrap_or(-1),
            l.token_usage.unwrap_or(0.0) * 100.0,
            l.num_running_reqs.unwrap_or(0),
            l.num_waiting_reqs.unwrap_or(0)
        );
    }
    Ok(())
}
