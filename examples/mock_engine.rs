//! A simulated vLLM or SGLang engine hosting N DP ranks, as a standalone server.
//!
//! cargo run --release --example mock_engine -- --listen 127.0.0.1:18001 --flavor vllm --dp-size 2 \
//!     [--start-rank S] [--kv-usage 0.1,0.8] [--preload 0.9,0] [--dark-ranks 1] [--garbage-ranks 0] \
//!     [--grpc-listen 127.0.0.1:50051] [--servicer-quirks]

use std::net::SocketAddr;

use clap::{Parser, ValueEnum};
use rankgate::sim::SimFlavor as Flavor;
use rankgate::sim::{SimConfig, SimEngine};
use rankgate::worker::RankNumbering;

#[derive(Clone, Copy, ValueEnum)]
enum FlavorArg {
    Vllm,
    Sglang,
}

#[derive(Clone, Copy, ValueEnum)]
enum Numbering {
    Global,
    Local,
}

#[derive(Parser)]
#[command(about = "Simulated inference engine with per-rank KV, queues and /metrics")]
struct Args {
    #[arg(long)]
    listen: SocketAddr,
    /// Also serve GetLoads / GetServerInfo / grpc.health.v1 here (h2c).
    #[arg(long)]
    grpc_listen: Option<SocketAddr>,
    /// Imitate smg-grpc-servicer 0.14.1: ignore the dp_rank filter, report summed capacity.
    #[arg(long)]
    servicer_quirks: bool,
    #[arg(long, value_enum)]
    flavor: FlavorArg,
    #[arg(long, default_value_t = 1)]
    dp_size: u32,
    /// Global rank of the first local rank.
    #[arg(long, default_value_t = 0)]
    start_rank: u32,
    /// Which numbering the pinning header is validated against.
    #[arg(long, value_enum, default_value = "global")]
    rank_numbering: Numbering,
    /// Reported KV usage per local rank, in order (pinned, whatever the real occupancy).
    #[arg(long, value_delimiter = ',')]
    kv_usage: Vec<f64>,
    /// Capacity taken by background load per local rank (0..1): the rank really is busy.
    #[arg(long, value_delimiter = ',')]
    preload: Vec<f64>,
    /// GLOBAL ranks whose series are left out of /metrics.
    #[arg(long, value_delimiter = ',')]
    dark_ranks: Vec<u32>,
    /// GLOBAL ranks that report invalid values (NaN KV, negative counts).
    #[arg(long, value_delimiter = ',')]
    garbage_ranks: Vec<u32>,
    /// KV capacity of each rank in tokens.
    #[arg(long, default_value_t = 4096)]
    capacity_tokens: u64,
    /// Decode rate of one request, tokens per second.
    #[arg(long, default_value_t = 200.0)]
    decode_rate: f64,
    #[arg(long, default_value = "tiny-llama")]
    model: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    for v in a.kv_usage.iter().chain(&a.preload) {
        anyhow::ensure!(
            (0.0..=1.0).contains(v),
            "--kv-usage and --preload take values in [0, 1], got {v}"
        );
    }
    anyhow::ensure!(a.dp_size >= 1, "--dp-size must be at least 1");
    anyhow::ensure!(a.decode_rate > 0.0, "--decode-rate must be positive");
    let cfg = SimConfig {
        flavor: match a.flavor {
            FlavorArg::Vllm => Flavor::Vllm,
            FlavorArg::Sglang => Flavor::Sglang,
        },
        dp_size: a.dp_size,
        start_rank: a.start_rank,
        rank_numbering: match a.rank_numbering {
            Numbering::Global => RankNumbering::Global,
            Numbering::Local => RankNumbering::Local,
        },
        capacity_tokens: a.capacity_tokens,
        preload: a.preload,
        kv_usage: a.kv_usage,
        dark_ranks: a.dark_ranks,
        garbage_ranks: a.garbage_ranks,
        decode_tokens_per_sec: a.decode_rate,
        model: a.model,
        servicer_quirks: a.servicer_quirks,
        ..SimConfig::default()
    };
    let engine = SimEngine::start(a.listen, cfg).await?;
    eprintln!("mock_engine listening on {}", engine.url());
    if let Some(g) = a.grpc_listen {
        eprintln!("mock_engine gRPC on {}", engine.start_grpc(g).await?);
    }
    tokio::signal::ctrl_c().await?;
    engine.shutdown().await;
    Ok(())
}
