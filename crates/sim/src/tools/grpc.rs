//! `rankgate grpc-client`: a gRPC client for an engine's own service, or for rankgate's gRPC
//! front door, which serves the same services: one streaming `Generate` (the worker that served
//! it is in the response's `x-rankgate-worker` metadata), then the per-rank loads from
//! `GetLoads`.

use std::time::{Duration, Instant};

use rankgate::telemetry::grpc::{transport, LoadsClient};
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
    let mut client = GrpcClient::new(flavor, &a.url)?;
    let call = GenerateCall {
        request_id: a.id.clone(),
        prompt_tokens: a.prompt_tokens,
        max_tokens: a.max_tokens,
        rank: None,
    };
    let started = Instant::now();
    let generation = tokio::time::timeout(CALL_TIMEOUT, async {
        let mut g = client.generate(&call).await?;
        println!(
            "Generate {:?}: served by {}",
            a.id,
            g.worker
                .as_deref()
                .unwrap_or("(no x-rankgate-worker: not through rankgate)")
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

    let origin = a.url.trim_end_matches('/');
    let loads = LoadsClient::new(flavor, origin, transport(Duration::from_secs(2)))?;
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
