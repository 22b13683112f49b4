//! Whether rankgate gives memory back after a burst: the real binary in front of simulated
//! engines (in this process, on 127.0.0.1), idle RSS measured, then `--streams` streaming chat
//! completions opened at once (each on its own connection) and run to their end, then RSS
//! sampled for `--after` seconds. Prints idle, peak and the samples after the burst.
//!
//! ```sh
//! cargo build --release --bin rankgate
//! cargo run --release --example burst_rss -- --streams 5000 --after 60
//! ```
//!
//! Needs a file-descriptor limit above twice `--streams` (`ulimit -n`).

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use common::Router;
use http_body_util::{BodyExt, Full};
use rankgate_sim::sim::{SimConfig, SimEngine};

#[derive(Parser)]
#[command(about = "rankgate's RSS before, during and after a burst of concurrent streams")]
struct Args {
    #[arg(long, default_value_t = 5000)]
    streams: usize,
    /// Tokens per stream (streamed at 20 tokens/s each: a 40-token stream lasts 2 s).
    #[arg(long, default_value_t = 40)]
    tokens: u64,
    /// Seconds of RSS samples after the burst.
    #[arg(long, default_value_t = 60)]
    after: u64,
    /// Extra environment for rankgate, `KEY=VALUE` (e.g. MALLOC_ARENA_MAX=2).
    #[arg(long)]
    env: Vec<String>,
}

fn rss_mib(pid: u32) -> Result<f64, String> {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| e.to_string())?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .ok_or("no VmRSS")?;
    Ok(kb / 1024.0)
}

/// The `rankgate serving` line's `addr=`.
fn front_addr(line: &str) -> Option<std::net::SocketAddr> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("addr="))?
        .parse()
        .ok()
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let args = Args::parse();
    let bin = common::rankgate_binary()?;
    let mut config = "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
                      [telemetry]\ninterval = \"100ms\"\n"
        .to_string();
    let mut engines = Vec::new();
    for e in 0..4u32 {
        let sim = SimEngine::start(
            ([127, 0, 0, 1], 0).into(),
            SimConfig {
                dp_size: 2,
                start_rank: 2 * e,
                capacity_tokens: 50_000_000,
                decode_tokens_per_sec: 20.0,
                ..SimConfig::default()
            },
        )
        .await
        .map_err(|err| err.to_string())?;
        config += &format!(
            "[[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\ndp_size = 2\nstart_rank = {}\n",
            sim.url(),
            2 * e
        );
        engines.push(sim);
    }
    let path = std::env::temp_dir().join(format!("rankgate-burst-{}.toml", std::process::id()));
    std::fs::write(&path, config).map_err(|e| e.to_string())?;
    let mut cmd = Command::new(bin);
    cmd.args(["serve", "--config"])
        .arg(&path)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for kv in &args.env {
        let (k, v) = kv.split_once('=').ok_or("--env takes KEY=VALUE")?;
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().map_err(|e| format!("starting rankgate: {e}"))?;
    let stderr = child.stderr.take().ok_or("no stderr")?;
    let router = Router(child);
    let pid = router.0.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if let Some(a) = front_addr(&line) {
                let _ = tx.send(a);
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(20))
        .map_err(|_| "rankgate did not log its address")?;
    // Let the polls settle before the idle figure.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = rss_mib(pid)?;

    let client = rankgate::http::client(Duration::from_secs(5));
    let body = serde_json::json!({
        "model": "tiny-llama", "stream": true, "max_tokens": args.tokens,
        "messages": [{"role": "user", "content": "hello"}],
    })
    .to_string();
    let started = std::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..args.streams {
        let client = client.clone();
        let req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.clone())))
            .map_err(|e| e.to_string())?;
        tasks.spawn(async move {
            let resp = client.request(req).await.ok()?;
            let ok = resp.status().is_success();
            let _ = tokio::time::timeout(Duration::from_secs(120), resp.into_body().collect())
                .await
                .ok()?
                .ok()?;
            Some(ok)
        });
    }
    let mut peak = idle;
    let mut ok = 0;
    let mut sampler = tokio::time::interval(Duration::from_millis(200));
    while !tasks.is_empty() {
        tokio::select! {
            done = tasks.join_next() => {
                if let Some(Ok(Some(true))) = done { ok += 1; }
            }
            _ = sampler.tick() => peak = peak.max(rss_mib(pid)?),
        }
    }
    drop(client);
    println!(
        "{} of {} streams ok in {:.1} s; rankgate RSS idle {idle:.0} MiB, peak {peak:.0} MiB",
        ok,
        args.streams,
        started.elapsed().as_secs_f64()
    );
    let mut line = String::from("after the burst:");
    for s in 0..=args.after {
        if s % 10 == 0 || s == args.after {
            let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count());
            line += &format!(" {s}s {:.0} MiB ({fds} fds)", rss_mib(pid)?);
        }
        if s < args.after {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    println!("{line}");
    let _ = std::fs::remove_file(&path);
    Ok(())
}
