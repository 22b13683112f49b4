//! `rankgate check`'s prefill/decode part, apart from the rest of `check` (`check.rs`): prefill
//! and decode servers whose flavors cannot pair are refused, and `--probe` asks each prefill
//! server what a disaggregated request needs of it (an SGLang bootstrap port that answers, a
//! vLLM prefill that returns `kv_transfer_params`). Each is a config that would pass every
//! health check and fail every request.

use std::process::ExitCode;

use rankgate::config::{Engine, Flavor};
use rankgate::telemetry::pd_probe::{self, PrefillServer};
use rankgate::telemetry::probe::Probed;

use crate::{EXIT_CONFIG, EXIT_UNAVAILABLE};

/// Prefill and decode servers whose configured flavors cannot pair: each printed, exit 64.
pub fn refused(cfg: &rankgate::config::Config) -> Option<ExitCode> {
    let errors = cfg.roles().errors;
    for e in &errors {
        eprintln!("rankgate: {e}");
    }
    (!errors.is_empty()).then(|| ExitCode::from(EXIT_CONFIG))
}

/// The flavor an engine has as configured, else as its probe read it.
fn flavor(e: &Engine, probed: Option<&Probed>) -> Option<Flavor> {
    e.declared.flavor.or_else(|| {
        let read = probed?.flavor.as_str();
        [Flavor::Vllm, Flavor::Sglang]
            .into_iter()
            .find(|f| f.as_str() == read)
    })
}

/// After the probe: the flavors the engines said, paired again, and each prefill server asked
/// what a disaggregated request needs of it. Every problem printed; exit 64 for flavors that
/// cannot pair, 69 for a prefill server that would fail every request.
pub fn probe(
    rt: &tokio::runtime::Runtime,
    engines: &[Engine],
    probed: &[Probed],
    timeout: std::time::Duration,
    upstream: &rankgate::tls::Upstream,
) -> Option<ExitCode> {
    let read = |e: &Engine| probed.iter().find(|p| *p.url == *e.url);
    let errors = rankgate::config::pairing_errors(engines, |_, e| flavor(e, read(e)));
    for e in &errors {
        eprintln!("rankgate: {e}");
    }
    if !errors.is_empty() {
        return Some(ExitCode::from(EXIT_CONFIG));
    }
    let servers: Vec<PrefillServer> = (engines.iter())
        .filter(|e| e.role == rankgate::config::Role::Prefill)
        .map(|e| PrefillServer {
            engine: e.clone(),
            flavor: flavor(e, read(e)),
            model: e.models.as_ref().and_then(|m| m.first().cloned()),
        })
        .collect();
    if servers.is_empty() {
        return None;
    }
    let problems = rt.block_on(pd_probe::probe(servers, timeout, upstream));
    for p in &problems {
        println!("prefill: {p}");
        eprintln!("rankgate: prefill server {p}");
    }
    (!problems.is_empty()).then(|| ExitCode::from(EXIT_UNAVAILABLE))
}
