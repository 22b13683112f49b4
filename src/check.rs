//! `rankgate check`: the config file validated as `serve` would read it (tokenizers and TLS files
//! included), one line per virtual worker, and with `--probe` each engine read once as the router
//! would read it.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::{config_path, load, runtime, EXIT_CONFIG, EXIT_UNAVAILABLE};

/// Runs `check`: exit 64 for a config error, 69 when `--probe` finds an engine whose ranks
/// would get no traffic (it does not answer, its health path fails, its shape is unknown).
pub fn run(config: Option<PathBuf>, probe: bool) -> ExitCode {
    let config = config_path(config);
    let cfg = match load(&config) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let warned = cfg.warnings();
    for w in &warned {
        eprintln!("rankgate: warning: {w}");
    }
    // The models' tokenizers, loaded as `serve` loads them.
    if let Err(e) = rankgate::prompt::Prompts::load(&cfg.models) {
        eprintln!("rankgate: {e}");
        return ExitCode::from(EXIT_CONFIG);
    }
    // The certificate, key and CA files, read as `serve` reads them.
    let upstream = match check_tls(&cfg) {
        Ok(u) => u,
        Err(e) => {
            eprintln!("rankgate: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let fleet = rankgate::worker::Fleet::expand(cfg.engines.clone());
    for w in &fleet.workers {
        let e = &fleet.engines[w.engine];
        // Which front doors send to it: the OpenAI HTTP one, the gRPC one, or both.
        let serves = match (e.http, &e.grpc) {
            (true, Some(g)) => format!("http,grpc={g}"),
            (false, Some(g)) => format!("grpc={g}"),
            (_, None) => "http".to_string(),
        };
        println!(
            "{}\tengine={}\trank={}\tflavor={}\tserves={serves}\trole={}",
            w.id,
            e.url,
            w.id.rank.map_or("-".to_string(), |r| r.to_string()),
            e.flavor,
            e.role_text()
        );
    }
    // An engine whose flavor or size is read from it has no workers until it answers.
    for e in fleet.engines.iter().filter(|e| !e.shaped()) {
        let unknown = match (e.declared.flavor, e.declared.dp_size) {
            (None, None) => "flavor and dp_size",
            (None, Some(_)) => "flavor",
            _ => "dp_size",
        };
        println!(
            "{}\tranks=read from the engine when it answers ({unknown} not set)\trole={}",
            e.url,
            e.role_text()
        );
    }
    for d in &cfg.discovery {
        let source = match &d.source {
            rankgate::config::DiscoverySource::Dns { name, .. } => format!("dns {name}"),
            rankgate::config::DiscoverySource::Kubernetes {
                namespace,
                selector,
                ..
            } => format!("kubernetes pods {namespace}/{selector}"),
        };
        println!(
            "{}\tfinds engines: {source}\tflavor={}\trole={}",
            d.at,
            d.template
                .flavor
                .map_or("read from each engine", |f| f.as_str()),
            d.template.role()
        );
    }
    // Each model's prefill and decode servers, where the file says (its warnings were
    // printed with the others above).
    for note in cfg.roles().notes {
        println!("note: {note}");
    }
    if let Some(code) = crate::check_pd::refused(&cfg) {
        return code;
    }
    if !probe {
        return ExitCode::SUCCESS;
    }
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    let mut engines = cfg.engines.clone();
    let probed = rt.block_on(rankgate::telemetry::probe::probe(
        cfg.engines,
        &cfg.telemetry,
        &upstream,
    ));
    println!("probe:");
    for p in &probed {
        println!("{}", p.line());
    }
    // With the model lists the engines gave, a model missing a side is known where the
    // file left it to each request.
    for e in engines.iter_mut().filter(|e| e.models.is_none()) {
        let read = probed.iter().find(|p| *p.url == *e.url);
        e.models = read.and_then(|p| p.models.clone());
    }
    let admin = cfg.server.admin_token_env.is_some();
    let read = rankgate::config::role_check(&engines, &cfg.discovery, admin);
    for w in read.warnings.iter().filter(|w| !warned.contains(*w)) {
        eprintln!("rankgate: warning: {w}");
    }
    // Prefill servers that would fail every disaggregated request.
    let timeout = cfg.telemetry.timeout;
    let pd = crate::check_pd::probe(&rt, &engines, &probed, timeout, &upstream);
    if !all_take_traffic(&probed) {
        return ExitCode::from(EXIT_UNAVAILABLE);
    }
    if let Some(code) = pd {
        return code;
    }
    ExitCode::SUCCESS
}

/// Whether every probed engine's ranks would get traffic; else each one that would not is
/// named, with why, on stderr (`check --probe` then exits 69): an engine that answers but whose
/// health path fails serves nothing, as surely as one that does not answer.
fn all_take_traffic(probed: &[rankgate::telemetry::probe::Probed]) -> bool {
    let idle: Vec<_> = (probed.iter())
        .filter_map(|p| Some((p, p.no_traffic()?)))
        .collect();
    for (p, why) in &idle {
        let ranks = match p.ranks.len() {
            0 => "its ranks".to_string(),
            n => format!("its {n} rank(s)"),
        };
        eprintln!("rankgate: {}: {ranks} would get no traffic: {why}", p.url);
    }
    if !idle.is_empty() {
        eprintln!(
            "rankgate: {} of {} engine(s) would serve nothing",
            idle.len(),
            probed.len()
        );
    }
    idle.is_empty()
}

/// Reads every TLS file the config names, as `serve` would at start.
fn check_tls(
    cfg: &rankgate::config::Config,
) -> Result<rankgate::tls::Upstream, rankgate::tls::TlsError> {
    use rankgate::tls::ServerTls;
    for (key, tls) in [
        ("server.tls", &cfg.server.tls),
        ("server.admin_tls", &cfg.server.admin_tls),
    ] {
        if let Some(t) = tls {
            if let Some(w) = ServerTls::load(key, t)?.expiry_warning() {
                eprintln!("rankgate: warning: {w}");
            }
        }
    }
    rankgate::tls::Upstream::load(&cfg.engine_tls)
}
