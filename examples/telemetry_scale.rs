//! What telemetry alone costs rankgate at fleet scale: the real binary, no traffic, polling
//! `--engines` simulated engines of `--ranks` DP ranks each (in this process, on 127.0.0.1) every
//! `--interval`; prints rankgate's CPU as a share of one core and its RSS, measured from
//! `/proc/<pid>/stat` over `--seconds` once every rank reports.
//!
//! ```sh
//! cargo build --release --bin rankgate
//! cargo run --release --example telemetry_scale -- --engines 64 --ranks 64   # 4,096 workers
//! ```

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use clap::Parser;
use common::Router;
use rankgate::config::parse_duration;
use rankgate_sim::sim::{SimConfig, SimEngine};

#[derive(Parser)]
#[command(about = "rankgate's idle CPU with a large simulated fleet")]
struct Args {
    #[arg(long, default_value_t = 64)]
    engines: u32,
    #[arg(long, default_value_t = 64)]
    ranks: u32,
    #[arg(long, default_value = "250ms", value_parser = parse_duration)]
    interval: Duration,
    /// How long CPU is measured for.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
}

/// CPU seconds (user + system) and RSS in MiB of `pid`.
fn usage(pid: u32) -> Result<(f64, f64), String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| e.to_string())?;
    // Fields after the command name (which may hold spaces) start at its closing parenthesis.
    let rest = stat.rsplit_once(')').ok_or("odd /proc stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| {
        f.get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .ok_or("odd /proc stat")
    };
    // SAFETY: sysconf reads a constant.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as f64;
    // utime and stime are fields 14 and 15 of the whole line, rss field 24.
    Ok((
        (num(11)? + num(12)?) / ticks,
        num(21)? * page / (1 << 20) as f64,
    ))
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let args = Args::parse();
    let bin = common::rankgate_binary()?;
    let mut engines = Vec::new();
    let mut config = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [telemetry]\ninterval = \"{}ms\"\nstale_after = \"{}ms\"\n",
        args.interval.as_millis(),
        (args.interval * 8).as_millis()
    );
    for e in 0..args.engines {
        let cfg = SimConfig {
            dp_size: args.ranks,
            kv_usage: (0..args.ranks).map(|r| f64::from(r % 10) / 20.0).collect(),
            ..SimConfig::default()
        };
        let sim = SimEngine::start(([127, 0, 0, 1], 0).into(), cfg)
            .await
            .map_err(|err| format!("simulated engine: {err}"))?;
        config += &format!(
            "[[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\ndp_size = {}\nstart_rank = {}\n",
            sim.url(),
            args.ranks,
            e * args.ranks
        );
        engines.push(sim);
    }
    let path = std::env::temp_dir().join(format!("rankgate-scale-{}.toml", std::process::id()));
    std::fs::write(&path, config).map_err(|e| e.to_string())?;
    let child = Command::new(bin)
        .args(["serve", "--config"])
        .arg(&path)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting rankgate: {e}"))?;
    let router = Router(child);
    let pid = router.0.id();
    // Every engine polled a few times over (each sim counts the polls it answered).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while engines.iter().any(|e| e.telemetry_requests() < 3) {
        if tokio::time::Instant::now() > deadline {
            return Err("engines not polled within 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (cpu0, _) = usage(pid)?;
    let polls0: u64 = engines.iter().map(|e| e.telemetry_requests()).sum();
    let start = std::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(args.seconds)).await;
    let (cpu1, rss) = usage(pid)?;
    let polls1: u64 = engines.iter().map(|e| e.telemetry_requests()).sum();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{} engines x {} ranks = {} workers, interval {} ms: rankgate {:.1}% of a core idle ({:.0} polls/s), RSS {:.0} MiB",
        args.engines,
        args.ranks,
        args.engines * args.ranks,
        args.interval.as_millis(),
        100.0 * (cpu1 - cpu0) / secs,
        (polls1 - polls0) as f64 / secs,
        rss
    );
    let _ = std::fs::remove_file(&path);
    Ok(())
}
