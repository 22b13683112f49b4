//! The simulated fleet of one row (3 vLLM engines x 2 DP ranks behind one rankgate in this
//! process, on 127.0.0.1 with ports picked by the OS), and switching a fault on and off in it.

use std::net::SocketAddr;
use std::time::Duration;

use rankgate::app::Router;
use rankgate::config::Config;
use rankgate_sim::sim::{SimConfig, SimEngine};
use tokio::time::Instant;

use crate::{fault::*, load::*};

/// Engines in the fleet, and DP ranks per engine.
pub const ENGINES: usize = 3;
pub const DP: u32 = 2;

/// A stalling engine stops after this many tokens.
const STALL_AFTER_TOKENS: u64 = 8;

/// rankgate under test: fast telemetry and short timeouts so each fault plays out in seconds.
/// The values are the ones the doc quotes; change both together.
const ROUTER_TOML: &str = r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
expose_worker = "url"
connect_timeout = "300ms"
response_timeout = "1s"
stream_idle_timeout = "1s"
drain_grace = "2s"

[routing]
max_attempts = 3
retry_budget = 0.2
eject_after = 5
eject_for = "1s"

[telemetry]
interval = "50ms"
stale_after = "500ms"
timeout = "200ms"
health_failures = 2
"#;

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn sim_config(i: usize) -> SimConfig {
    SimConfig {
        dp_size: DP,
        start_rank: i as u32 * DP,
        decode_tokens_per_sec: DECODE_TOKENS_PER_SEC,
        ..SimConfig::default()
    }
}

/// The fleet of one row.
pub struct Fleet {
    pub engines: Vec<SimEngine>,
    /// Engines killed and replaced, kept until the end so their counters can be read.
    pub dead: Vec<SimEngine>,
    pub router: Router,
}

pub async fn start_fleet(fault: Fault) -> Result<Fleet, String> {
    let mut engines = Vec::with_capacity(ENGINES);
    for i in 0..ENGINES {
        let mut cfg = sim_config(i);
        // The model list is read once at start and then about once a minute, so a hang that
        // starts mid-run would never be seen: this one is there from the engine's start.
        cfg.hang_models = fault == Fault::HangModels && i == 0;
        let e = SimEngine::start(loopback(), cfg)
            .await
            .map_err(|e| format!("engine {i}: {e}"))?;
        engines.push(e);
    }
    let mut text = ROUTER_TOML.to_string();
    for (i, e) in engines.iter().enumerate() {
        text.push_str(&format!(
            "\n[[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\ndp_size = {DP}\nstart_rank = {}\n",
            e.url(),
            i as u32 * DP
        ));
    }
    let cfg = Config::from_str(&text).map_err(|e| format!("config: {e}"))?;
    let router = Router::start(cfg)
        .await
        .map_err(|e| format!("router: {e}"))?;
    Ok(Fleet {
        engines,
        dead: Vec::new(),
        router,
    })
}

/// Waits (at most `limit`) until `/workers` shows every rank available.
pub async fn wait_all_available(admin: SocketAddr, limit: Duration) -> Result<(), String> {
    let client: HttpClient = rankgate::http::client(Duration::from_secs(1));
    let deadline = Instant::now() + limit;
    let mut last = String::new();
    while Instant::now() < deadline {
        match workers(&client, admin).await {
            Ok(rows) if rows.iter().all(|r| r["telemetry"] == "available") => return Ok(()),
            Ok(rows) => {
                last = rows
                    .iter()
                    .filter(|r| r["telemetry"] != "available")
                    .map(|r| format!("{}: {}", r["id"], r["reason"]))
                    .collect::<Vec<_>>()
                    .join("; ")
            }
            Err(e) => last = e,
        }
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    Err(format!("not all ranks available within {limit:?}: {last}"))
}

/// Switches the fault on. Returns notes on anything that went wrong.
pub async fn apply(fault: Fault, fleet: &mut Fleet) -> Vec<String> {
    let mut notes = Vec::new();
    let e0 = &fleet.engines[0];
    match fault {
        Fault::Baseline | Fault::HangModels => {}
        Fault::Kill => e0.kill().await,
        Fault::HangRequests => e0.set_hang_requests(true),
        Fault::Stall => e0.set_stall_after_tokens(Some(STALL_AFTER_TOKENS)),
        Fault::Fail503One => {
            if let Err(e) = e0.set_fail(503, 100.0) {
                notes.push(format!("set_fail: {e}"));
            }
        }
        Fault::Health503 => {
            if let Err(e) = e0.set_health_status(503) {
                notes.push(format!("set_health_status: {e}"));
            }
        }
        Fault::HangMetrics => e0.set_hang_metrics(true),
        Fault::Fail503All => {
            for e in &fleet.engines {
                if let Err(err) = e.set_fail(503, 100.0) {
                    notes.push(format!("set_fail: {err}"));
                }
            }
        }
    }
    notes
}

/// Switches the fault off (a killed engine is started again on its old port).
pub async fn clear(fault: Fault, fleet: &mut Fleet) -> Vec<String> {
    let mut notes = Vec::new();
    let e0 = &fleet.engines[0];
    match fault {
        Fault::Baseline => {}
        Fault::Kill => {
            // Same address, so rankgate's config still points at it: a process restarted by
            // its supervisor.
            let addr = e0.addr;
            match SimEngine::start(addr, sim_config(0)).await {
                Ok(e) => {
                    let old = std::mem::replace(&mut fleet.engines[0], e);
                    fleet.dead.push(old);
                }
                Err(e) => notes.push(format!("restart on {addr} failed: {e}")),
            }
        }
        Fault::HangRequests => e0.set_hang_requests(false),
        Fault::Stall => e0.set_stall_after_tokens(None),
        Fault::Fail503One => {
            if let Err(e) = e0.set_fail(503, 0.0) {
                notes.push(format!("set_fail: {e}"));
            }
        }
        Fault::Health503 => {
            if let Err(e) = e0.set_health_status(200) {
                notes.push(format!("set_health_status: {e}"));
            }
        }
        Fault::HangMetrics => e0.set_hang_metrics(false),
        Fault::HangModels => e0.set_hang_models(false),
        Fault::Fail503All => {
            for e in &fleet.engines {
                if let Err(err) = e.set_fail(503, 0.0) {
                    notes.push(format!("set_fail: {err}"));
                }
            }
        }
    }
    notes
}
