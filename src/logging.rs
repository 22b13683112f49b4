//! Where rankgate's logs go and what they hold: text or JSON lines on stderr, filtered by
//! `RUST_LOG` (default `info`), with the HTTP/2, hyper, TLS and client-library internals quiet
//! unless `RUST_LOG` names them: at `debug`, their frame-by-frame lines from every telemetry poll
//! would drown rankgate's own. A `RUST_LOG` that does not parse is an error, never ignored.

use std::str::FromStr;

use tracing_subscriber::filter::{LevelFilter, Targets};

/// The log line format (`rankgate serve --log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines, colored on a terminal.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, fields, span), for log pipelines.
    Json,
}

impl FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<LogFormat, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("{other:?}: use text or json")),
        }
    }
}

/// Libraries whose debug and trace lines are about frames and connections, not the fleet.
const QUIET: [&str; 12] = [
    "h2",
    "hyper",
    "hyper_util",
    "tower",
    "tonic",
    "rustls",
    "kube",
    "kube_client",
    "kube_runtime",
    "hickory_proto",
    "hickory_resolver",
    "mio",
];

/// The filter for `rust_log` (the `RUST_LOG` value, if set). Errors name what does not parse.
pub fn filter(rust_log: Option<&str>) -> Result<Targets, String> {
    let spec = rust_log
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .unwrap_or("info");
    let mut targets = Targets::new();
    let mut named: Vec<&str> = Vec::new();
    for directive in spec.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let (target, level) = match directive.split_once('=') {
            Some((t, l)) => (Some(t.trim()), l.trim()),
            // A bare level is the default; a bare name is that target at every level.
            None => match LevelFilter::from_str(directive) {
                Ok(_) => (None, directive),
                Err(_) => (Some(directive), "trace"),
            },
        };
        let level = LevelFilter::from_str(level)
            .map_err(|_| format!("RUST_LOG={spec:?}: {level:?} in {directive:?} is not a level (use error, warn, info, debug, trace or off)"))?;
        match target {
            Some(t) if t.is_empty() || t.contains(|c: char| c.is_whitespace() || "[]{}\"".contains(c)) => {
                return Err(format!(
                    "RUST_LOG={spec:?}: {t:?} in {directive:?} is not a target (a module path such as rankgate::proxy); span and field filters are not supported"
                ))
            }
            Some(t) => {
                named.push(t);
                targets = targets.with_target(t, level);
            }
            None => targets = targets.with_default(level),
        }
    }
    for quiet in QUIET {
        let asked = named
            .iter()
            .any(|n| *n == quiet || n.starts_with(&format!("{quiet}::")));
        if !asked {
            targets = targets.with_target(quiet, LevelFilter::WARN);
        }
    }
    Ok(targets)
}

/// Installs the subscriber: `format` lines on stderr, filtered by `RUST_LOG`.
pub fn init(format: LogFormat) -> Result<(), String> {
    use tracing_subscriber::prelude::*;
    let filter = filter(std::env::var("RUST_LOG").ok().as_deref())?;
    let layer = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Text => registry
            .with(layer.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())))
            .init(),
        LogFormat::Json => registry
            .with(layer.json().flatten_event(true).with_current_span(true))
            .init(),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing::Level;

    fn enabled(t: &Targets, target: &str, level: Level) -> bool {
        t.would_enable(target, &level)
    }

    #[test]
    fn internals_stay_quiet_unless_named() {
        let t = filter(Some("debug")).unwrap();
        assert!(enabled(&t, "rankgate::telemetry", Level::DEBUG));
        assert!(!enabled(&t, "h2::codec", Level::DEBUG));
        assert!(!enabled(&t, "hyper_util::client", Level::INFO));
        assert!(enabled(&t, "hyper", Level::WARN));
        let t = filter(Some("info,h2=trace")).unwrap();
        assert!(enabled(&t, "h2::codec", Level::TRACE));
        assert!(!enabled(&t, "hyper", Level::INFO));
        let t = filter(None).unwrap();
        assert!(enabled(&t, "rankgate", Level::INFO));
        assert!(!enabled(&t, "rankgate", Level::DEBUG));
    }

    #[test]
    fn a_bad_rust_log_is_named() {
        for (spec, want) in [
            (
                "rankgate=loud",
                "\"loud\" in \"rankgate=loud\" is not a level",
            ),
            ("info,[span]=debug", "is not a target"),
            ("=debug", "is not a target"),
        ] {
            let err = filter(Some(spec)).unwrap_err();
            assert!(err.contains(want), "{spec}: {err}");
        }
        // A bare target name is that target at every level.
        let t = filter(Some("warn,rankgate::proxy")).unwrap();
        assert!(enabled(&t, "rankgate::proxy::send", Level::TRACE));
        assert!(!enabled(&t, "rankgate::telemetry", Level::INFO));
    }
}
