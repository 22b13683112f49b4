//! Where rankgate's logs go and what they hold: text or JSON lines on stderr, filtered by
//! `RUST_LOG` (default `info`), with the HTTP/2, hyper, TLS and client-library internals quiet
//! unless `RUST_LOG` names them: at `debug`, their frame-by-frame lines from every telemetry poll
//! would drown rankgate's own. A `RUST_LOG` that does not parse is an error, never ignored.
//!
//! The request spans (target `rankgate::trace`) are off in the logs unless `RUST_LOG` names
//! that target; then each prints one line when it closes, with the pick it made. OTLP export
//! (feature `otlp`) takes them whatever `RUST_LOG` says.

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
    let asked = |target: &str| {
        (named.iter()).any(|n| *n == target || n.starts_with(&format!("{target}::")))
    };
    for quiet in QUIET {
        if !asked(quiet) {
            targets = targets.with_target(quiet, LevelFilter::WARN);
        }
    }
    if !asked(TRACE) {
        targets = targets.with_target(TRACE, LevelFilter::OFF);
    }
    Ok(targets)
}

/// The request and upstream spans' target.
const TRACE: &str = "rankgate::trace";

/// What logging keeps running until the process ends: the OTLP export, flushed by
/// [`Logging::finish`].
#[derive(Default)]
pub struct Logging {
    #[cfg(feature = "otlp")]
    export: Option<crate::otlp::Export>,
}

impl Logging {
    /// Flushes what is still to be exported. Blocks: call it outside the runtime's tasks, with
    /// the runtime still running.
    pub fn finish(self) {
        #[cfg(feature = "otlp")]
        if let Some(e) = self.export {
            e.shutdown();
        }
    }
}

/// Installs the subscriber: `format` lines on stderr, filtered by `RUST_LOG`; and, when
/// `tracing` asks for it, the OTLP export (its HTTP requests run on `runtime`).
pub fn init(
    format: LogFormat,
    tracing: &crate::config::TracingConfig,
    runtime: &tokio::runtime::Handle,
) -> Result<Logging, String> {
    use tracing_subscriber::fmt::format::FmtSpan;
    use tracing_subscriber::prelude::*;
    use tracing_subscriber::{Layer, Registry};
    let filter = filter(std::env::var("RUST_LOG").ok().as_deref())?;
    let layer = (tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with_span_events(FmtSpan::CLOSE);
    let lines: Box<dyn Layer<Registry> + Send + Sync> = match format {
        LogFormat::Text => layer
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => layer
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_filter(filter)
            .boxed(),
    };
    let registry = tracing_subscriber::registry().with(lines);
    #[cfg(feature = "otlp")]
    if let Some((export, running)) = crate::otlp::layer(tracing, runtime.clone())? {
        registry.with(export).init();
        return Ok(Logging {
            export: Some(running),
        });
    }
    let _ = (tracing, runtime);
    registry.init();
    Ok(Logging::default())
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
    fn request_spans_are_off_unless_named() {
        for spec in [None, Some("debug"), Some("trace"), Some("rankgate=trace")] {
            let t = filter(spec).unwrap();
            assert!(!enabled(&t, "rankgate::trace", Level::INFO), "{spec:?}");
        }
        let t = filter(Some("info,rankgate::trace=info")).unwrap();
        assert!(enabled(&t, "rankgate::trace", Level::INFO));
        assert!(!enabled(&t, "h2", Level::INFO));
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
