//! The `rankgate` binary: parse the command line, load and validate the config, run.

mod check;
mod check_pd;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use rankgate::config::Config;

/// Exit code for a config error (EX_DATAERR's neighbour EX_USAGE, as sysexits.h numbers it).
const EXIT_CONFIG: u8 = 64;
/// Exit code of `check --probe` when an engine does not answer (sysexits' EX_UNAVAILABLE).
const EXIT_UNAVAILABLE: u8 = 69;
/// Exit code when a second signal cuts the drain short (128 + SIGINT, as shells report it).
const EXIT_INTERRUPTED: u8 = 130;

/// SIGTERM (what Kubernetes, systemd and `docker stop` send) and SIGINT (Ctrl-C), as one
/// stream; SIGHUP reloads the config file and the TLS certificates.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    /// The name of the next stopping signal (during the drain: SIGHUP is no longer acted on).
    async fn stop(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }

    /// The name of the next stopping signal received; reloads on each SIGHUP until then.
    async fn next(&mut self, router: &rankgate::app::Router) -> &'static str {
        loop {
            tokio::select! {
                _ = self.term.recv() => return "SIGTERM",
                _ = self.int.recv() => return "SIGINT",
                _ = self.hup.recv() => {
                    router.reload_certificates();
                    match router.reload().await {
                        Ok(done) => tracing::info!(
                            added = ?done.outcome.added, removed = ?done.outcome.removed,
                            restart_needed = ?done.restart_needed, "SIGHUP: config reloaded"
                        ),
                        Err(error) => tracing::error!(%error, "SIGHUP: reload refused, the fleet is unchanged"),
                    }
                }
            }
        }
    }
}

#[derive(Parser)]
#[command(
    name = "rankgate",
    version,
    about = "Per-DP-rank load-aware front door for vLLM and SGLang fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the router.
    Serve {
        /// The config file [default: ./rankgate.toml if it exists, else
        /// /etc/rankgate/rankgate.toml]
        #[arg(long)]
        config: Option<PathBuf>,
        /// Log lines as `text` or `json` (one object per line), on stderr.
        #[arg(long, default_value = "text")]
        log_format: rankgate::logging::LogFormat,
    },
    /// Validate a config file and list its virtual workers.
    Check {
        /// The config file [default: ./rankgate.toml if it exists, else
        /// /etc/rankgate/rankgate.toml]
        #[arg(long)]
        config: Option<PathBuf>,
        /// Also read each engine once, as the router would: reachable, flavor, DP size, models,
        /// the telemetry source that answered, KV-cache events offered. Exits 69 when an engine
        /// does not answer.
        #[arg(long)]
        probe: bool,
    },
    /// Self-contained demo: simulated engines, the router, a bounded load run per policy.
    #[cfg(feature = "sim")]
    Demo {
        /// Requests per policy (default: the demo scenario's 400).
        #[arg(long)]
        requests: Option<usize>,
        /// Mean arrivals per second (default: the demo scenario's 24).
        #[arg(long)]
        rate: Option<f64>,
    },
    /// A simulated vLLM or SGLang engine with N DP ranks (per-rank KV, queues, /metrics, gRPC),
    /// for trying rankgate without GPUs; each rank as big and as fast as Llama-3.1-8B on one
    /// 80 GB GPU unless told otherwise.
    #[cfg(feature = "sim")]
    MockEngine(Box<rankgate_sim::sim::cli::Args>),
    /// Load client: TTFT / ITL / E2E percentiles and per-rank counts against any
    /// OpenAI-compatible URL or gRPC service, or a routing-quality scenario run once per policy.
    #[cfg(feature = "sim")]
    Load(Box<rankgate_sim::tools::load::Args>),
    /// The requests an application using the `openai` SDK makes first, and which rank served each.
    #[cfg(feature = "sim")]
    OpenaiClient(rankgate_sim::tools::openai::Args),
    /// One streaming gRPC `Generate` and a `GetLoads`, against rankgate's gRPC front door or an
    /// engine's.
    #[cfg(feature = "sim")]
    GrpcClient(rankgate_sim::tools::grpc::Args),
    /// Live terminal view of every rank of a running rankgate, read from its admin listener.
    #[cfg(feature = "top")]
    Top {
        /// The admin listener (`server.admin_listen`).
        #[arg(long, default_value = "http://127.0.0.1:9090")]
        admin: String,
        /// How often to poll it (100ms to 60s).
        #[arg(long, default_value = "1s", value_parser = rankgate_top::parse_interval)]
        interval: std::time::Duration,
        /// For an https:// admin listener: the CA its certificate is checked against (PEM);
        /// default: the system's roots.
        #[arg(long)]
        ca_file: Option<PathBuf>,
    },
}

/// The config, with the client keys it names readable: both are config errors (exit 64), for
/// `check` as for `serve`. The router reads the keys again when it starts.
fn load(path: &std::path::Path) -> Result<Config, ExitCode> {
    let cfg = Config::load(path).map_err(|e| {
        eprintln!("rankgate: {e}");
        ExitCode::from(EXIT_CONFIG)
    })?;
    if let Err(e) = rankgate::proxy::Keys::load(&cfg.server, &cfg.flow) {
        eprintln!("rankgate: config file {}: {e}", path.display());
        return Err(ExitCode::from(EXIT_CONFIG));
    }
    Ok(cfg)
}

fn runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            eprintln!("rankgate: cannot start the async runtime: {e}");
            ExitCode::FAILURE
        })
}

/// The config file: the one given, else `./rankgate.toml` where it exists, else the system one.
fn config_path(given: Option<PathBuf>) -> PathBuf {
    given.unwrap_or_else(|| {
        let local = PathBuf::from("rankgate.toml");
        match local.is_file() {
            true => local,
            false => PathBuf::from("/etc/rankgate/rankgate.toml"),
        }
    })
}

/// A subcommand this build leaves out (the production build has no simulator or `top`): what
/// to run instead, rather than clap's bare "unrecognized subcommand".
fn left_out(arg: Option<&str>) -> Option<&'static str> {
    match arg {
        Some("mock-engine") if !cfg!(feature = "sim") => Some(
            "this rankgate was built without the simulator (`--no-default-features`), so it has no `mock-engine`: run it from a default build, `cargo run --release -- mock-engine ...`",
        ),
        Some("load" | "openai-client" | "grpc-client") if !cfg!(feature = "sim") => Some(
            "this rankgate was built without the simulator and client tools (`--no-default-features`): run them from a default build, `cargo run --release -- load ...`",
        ),
        Some("demo") if !cfg!(feature = "sim") => Some(
            "this rankgate was built without the simulator (`--no-default-features`), so it has no `demo`: run it from a default build, `cargo run --release -- demo`",
        ),
        Some("top") if !cfg!(feature = "top") => Some(
            "this rankgate was built without `top` (`--no-default-features`): run it from a default build, `cargo run --release -- top`, or read GET /workers on the admin listener",
        ),
        _ => None,
    }
}

/// Runs one of the client tools to its end: exit 1, with the tool's message, when it fails.
#[cfg(feature = "sim")]
fn tool(name: &str, run: impl std::future::Future<Output = Result<(), String>>) -> ExitCode {
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match rt.block_on(run) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rankgate {name}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let first = std::env::args().nth(1);
    if let Some(why) = left_out(first.as_deref()) {
        eprintln!("rankgate: {why}");
        return ExitCode::from(2);
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Check { config, probe } => check::run(config, probe),
        Command::Serve { config, log_format } => {
            let config = config_path(config);
            let cfg = match load(&config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let rt = match runtime() {
                Ok(rt) => rt,
                Err(code) => return code,
            };
            let logging = match rankgate::logging::init(log_format, &cfg.tracing, rt.handle()) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("rankgate: {e}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            // Before any port binds, and outside the runtime's tasks: resolving names blocks.
            for w in cfg.warnings() {
                tracing::warn!("config: {w}");
            }
            let code = rt.block_on(async {
                // Before the first listener binds: a SIGHUP's default action would kill the
                // process and a SIGTERM would skip the drain. One sent while starting waits in
                // its stream and is acted on as soon as the router serves.
                let mut signals = match Signals::new() {
                    Ok(s) => s,
                    Err(e) => {
                        eprintln!("rankgate: cannot listen for signals: {e}");
                        return ExitCode::FAILURE;
                    }
                };
                tracing::info!("signals: SIGTERM and SIGINT drain, SIGHUP reloads; starting");
                let router = match rankgate::app::Router::start_from(cfg, Some(config)).await {
                    Ok(r) => r,
                    Err(e) => {
                        eprintln!("rankgate: {e}");
                        return match e.is_config() {
                            true => ExitCode::from(EXIT_CONFIG),
                            false => ExitCode::FAILURE,
                        };
                    }
                };
                let first = signals.next(&router).await;
                tracing::info!(signal = first, "shutting down: /ready is 503, draining requests in flight");
                let cut = router.cut_handle();
                let mut shutdown = std::pin::pin!(router.shutdown());
                tokio::select! {
                    _ = &mut shutdown => {
                        tracing::info!("drained; exiting");
                        ExitCode::SUCCESS
                    }
                    second = signals.stop() => {
                        tracing::warn!(signal = second, "second signal: cutting the streams still running and exiting without waiting for the drain");
                        // Each cut stream's last event (SSE's error event, gRPC's status)
                        // goes out before the process ends; at most CUT_FLUSH.
                        cut.now().await;
                        ExitCode::from(EXIT_INTERRUPTED)
                    }
                }
            });
            // The last spans go out while the runtime still runs.
            logging.finish();
            code
        }
        #[cfg(feature = "sim")]
        Command::MockEngine(args) => {
            let rt = match runtime() {
                Ok(rt) => rt,
                Err(code) => return code,
            };
            match rt.block_on(rankgate_sim::sim::cli::run(*args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("rankgate mock-engine: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        #[cfg(feature = "sim")]
        Command::Demo { requests, rate } => {
            let rt = match runtime() {
                Ok(rt) => rt,
                Err(code) => return code,
            };
            let result = rankgate_sim::demo::scenario(requests, rate)
                .and_then(|s| rt.block_on(rankgate_sim::demo::run(s)));
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("rankgate demo: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        #[cfg(feature = "sim")]
        Command::Load(args) => tool("load", rankgate_sim::tools::load::run(*args)),
        #[cfg(feature = "sim")]
        Command::OpenaiClient(args) => {
            tool("openai-client", rankgate_sim::tools::openai::run(args))
        }
        #[cfg(feature = "sim")]
        Command::GrpcClient(args) => tool("grpc-client", rankgate_sim::tools::grpc::run(args)),
        #[cfg(feature = "top")]
        Command::Top {
            admin,
            interval,
            ca_file,
        } => {
            let rt = match runtime() {
                Ok(rt) => rt,
                Err(code) => return code,
            };
            match rt.block_on(rankgate_top::run(&admin, interval, ca_file.as_deref())) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    // Not eprintln!: it panics when stderr was the terminal that went away.
                    use std::io::Write;
                    let _ = writeln!(std::io::stderr(), "rankgate top: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
