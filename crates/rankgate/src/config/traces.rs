//! `[tracing]`: exporting the request and upstream spans over OTLP. Off unless
//! `otlp_endpoint` is set, and only in a build with the `otlp` feature; a file that asks for it
//! from a build without it is refused at load, not silently left untraced.

use serde::Deserialize;

use super::error::{invalid, ConfigError};

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTracing {
    otlp_endpoint: Option<String>,
    sample_ratio: Option<f64>,
    service_name: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TracingConfig {
    /// Where spans go: the collector's OTLP/HTTP traces URL (`/v1/traces` added when the URL
    /// names no path). `None`: no export.
    pub otlp_endpoint: Option<String>,
    /// Share of the traces rankgate starts that are exported; a client's own sampling decision
    /// (its `traceparent` flags) is kept.
    pub sample_ratio: f64,
    /// The `service.name` resource attribute.
    pub service_name: String,
}

impl Default for TracingConfig {
    fn default() -> TracingConfig {
        TracingConfig {
            otlp_endpoint: None,
            sample_ratio: 1.0,
            service_name: "rankgate".into(),
        }
    }
}

pub(super) fn tracing_config(raw: RawTracing) -> Result<TracingConfig, ConfigError> {
    let mut cfg = TracingConfig::default();
    if let Some(r) = raw.sample_ratio {
        if !(0.0..=1.0).contains(&r) {
            return Err(invalid(
                "tracing.sample_ratio",
                format!("{r} is not a share between 0 and 1"),
            ));
        }
        cfg.sample_ratio = r;
    }
    if let Some(name) = raw.service_name {
        if name.trim().is_empty() {
            return Err(invalid("tracing.service_name", "must not be empty"));
        }
        cfg.service_name = name;
    }
    let Some(url) = raw.otlp_endpoint else {
        return Ok(cfg);
    };
    if cfg!(not(feature = "otlp")) {
        return Err(invalid(
            "tracing.otlp_endpoint",
            "this rankgate was built without OTLP export: build it with `--features otlp`",
        ));
    }
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        invalid(
            "tracing.otlp_endpoint",
            format!("{url:?} must start with http:// (spans go to a collector over plain HTTP, OTLP/HTTP protobuf)"),
        )
    })?;
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let parsed = authority.parse::<http::uri::Authority>();
    if authority.is_empty()
        || authority.contains('@')
        || parsed.is_err()
        || authority.starts_with(':')
    {
        return Err(invalid(
            "tracing.otlp_endpoint",
            format!("{url:?} has no usable host:port"),
        ));
    }
    let path = match path.trim_end_matches('/') {
        "" => "/v1/traces",
        p => p,
    };
    cfg.otlp_endpoint = Some(format!("http://{authority}{path}"));
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(toml: &str) -> Result<TracingConfig, String> {
        let raw: RawTracing = toml::from_str(toml).map_err(|e| e.to_string())?;
        tracing_config(raw).map_err(|e| e.to_string())
    }

    #[test]
    fn off_by_default() {
        let cfg = parse("").unwrap();
        assert_eq!(cfg, TracingConfig::default());
        assert!(cfg.otlp_endpoint.is_none());
    }

    #[test]
    fn bad_values_are_named() {
        let e = parse("sample_ratio = 1.5").unwrap_err();
        assert!(
            e.contains("tracing.sample_ratio") && e.contains("1.5"),
            "{e}"
        );
        let e = parse("service_name = \" \"").unwrap_err();
        assert!(e.contains("tracing.service_name"), "{e}");
        let e = parse("otlp_exporter = \"x\"").unwrap_err();
        assert!(e.contains("otlp_exporter"), "{e}");
    }

    #[cfg(feature = "otlp")]
    #[test]
    fn endpoints_get_the_traces_path_when_they_name_none() {
        let url =
            |u: &str| parse(&format!("otlp_endpoint = {u:?}")).map(|c| c.otlp_endpoint.unwrap());
        assert_eq!(
            url("http://otel:4318").unwrap(),
            "http://otel:4318/v1/traces"
        );
        assert_eq!(
            url("http://otel:4318/").unwrap(),
            "http://otel:4318/v1/traces"
        );
        assert_eq!(
            url("http://otel:4318/custom/traces").unwrap(),
            "http://otel:4318/custom/traces"
        );
        for bad in [
            "https://otel:4318",
            "otel:4318",
            "http://",
            "http://:4318",
            "http://u@otel:1",
        ] {
            let e = url(bad).unwrap_err();
            assert!(e.contains("tracing.otlp_endpoint"), "{bad}: {e}");
        }
    }

    #[cfg(not(feature = "otlp"))]
    #[test]
    fn a_build_without_otlp_refuses_the_endpoint() {
        let e = parse("otlp_endpoint = \"http://otel:4318\"").unwrap_err();
        assert!(e.contains("--features otlp"), "{e}");
    }
}
