//! Where an engine is reached (`url`, `grpc_url`) and where its load is read (`telemetry`):
//! the URL rules, and each flavor's default sources.

use super::engine::{Flavor, TelemetrySource};
use super::error::{invalid, ConfigError};

/// Checks an engine base URL: `http://host:port` or `https://host:port`, no userinfo, no `@`,
/// no path, no query. Returns the normalised URL, its authority, and whether it is TLS.
pub(super) fn parse_engine_url(
    key: &str,
    url: &str,
) -> Result<(String, String, bool), ConfigError> {
    let (scheme, rest, tls) = match (url.strip_prefix("http://"), url.strip_prefix("https://")) {
        (Some(rest), _) => ("http", rest, false),
        (_, Some(rest)) => ("https", rest, true),
        _ => {
            return Err(invalid(
                key,
                format!("{url:?} must start with http:// or https://"),
            ))
        }
    };
    if url.contains('@') {
        return Err(invalid(
            key,
            format!("{url:?} contains '@': give the engine's base URL; ranks come from dp_size and start_rank"),
        ));
    }
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.contains(['/', '?', '#']) {
        return Err(invalid(
            key,
            format!("{url:?} carries a path or query: give the engine's base URL only"),
        ));
    }
    let uri: http::uri::Authority = authority
        .parse()
        .map_err(|_| invalid(key, format!("{url:?} has no valid host:port")))?;
    if uri.host().is_empty() {
        return Err(invalid(key, format!("{url:?} has no host")));
    }
    if uri.port_u16().is_none() {
        return Err(invalid(key, format!("{url:?} has no port")));
    }
    Ok((
        format!("{scheme}://{authority}"),
        authority.to_string(),
        tls,
    ))
}

/// Where an engine is reached: its OpenAI HTTP `url`, its `grpc_url`, or both.
pub(super) struct Addresses {
    /// The engine's identity: its HTTP base URL, or its gRPC one when it has only that.
    pub url: String,
    pub authority: String,
    pub http: bool,
    /// Its URLs are `https://`.
    pub tls: bool,
    /// `host:port` of its gRPC service.
    pub grpc: Option<String>,
}

/// The addresses an entry gives (`url`, `grpc_url`), checked against each other and its
/// declared flavor.
pub(super) fn engine_addresses(
    at: &str,
    url: Option<&str>,
    grpc_url: Option<&str>,
    flavor: Option<Flavor>,
) -> Result<Addresses, ConfigError> {
    let http = url
        .map(|u| parse_engine_url(&format!("{at}.url"), u))
        .transpose()?;
    let grpc = grpc_url
        .map(|u| parse_engine_url(&format!("{at}.grpc_url"), u))
        .transpose()?;
    if grpc.is_some() && flavor == Some(Flavor::Gateway) {
        return Err(invalid(
            format!("{at}.grpc_url"),
            "a gateway is fronted over HTTP only: remove this key",
        ));
    }
    if let (Some((_, _, h)), Some((_, _, g))) = (&http, &grpc) {
        if h != g {
            return Err(invalid(
                format!("{at}.grpc_url"),
                "url and grpc_url are both http:// or both https://: one engine, one TLS setting",
            ));
        }
    }
    let grpc_authority = grpc.as_ref().map(|(_, a, _)| a.clone());
    let ((url, authority, tls), http) = match (http, grpc) {
        (Some(h), _) => (h, true),
        (None, Some(g)) => (g, false),
        (None, None) => {
            return Err(invalid(
                at,
                "needs `url` (its OpenAI HTTP API), `grpc_url` (its gRPC service, http://host:port), or both",
            ))
        }
    };
    Ok(Addresses {
        url,
        authority,
        http,
        tls,
        grpc: grpc_authority,
    })
}

/// Default telemetry sources: `GetLoads` where the engine serves gRPC (per rank, exact), then
/// per flavor the native per-rank endpoint where the engine has one without extra
/// configuration, Prometheus as the fallback.
pub(super) fn default_sources(flavor: Flavor, url: &str, a: &Addresses) -> Vec<TelemetrySource> {
    let grpc = a.grpc.iter().map(|authority| TelemetrySource::Grpc {
        authority: authority.as_str().into(),
        tls: a.tls,
    });
    if !a.http {
        return grpc.collect();
    }
    grpc.chain(http_sources(flavor, url)).collect()
}

fn http_sources(flavor: Flavor, url: &str) -> Vec<TelemetrySource> {
    match flavor {
        Flavor::Vllm => vec![TelemetrySource::Prometheus],
        Flavor::Sglang => vec![
            TelemetrySource::Http {
                url: format!("{url}/v1/loads?include=core").into(),
            },
            TelemetrySource::Prometheus,
        ],
        Flavor::Gateway => vec![TelemetrySource::Http {
            url: format!("{url}/loads").into(),
        }],
    }
}

/// Parses `telemetry = [...]`: `"grpc://host:port"` (`"grpcs://"` over TLS), `"http"` (the
/// flavor's loads path on the engine URL), `"http://host:port/path"` or `"https://..."` (an
/// explicit loads URL), `"prometheus"`.
pub(super) fn parse_sources(
    at: &str,
    flavor: Flavor,
    url: &str,
    addresses: &Addresses,
    list: Option<&[String]>,
) -> Result<Vec<TelemetrySource>, ConfigError> {
    let key = format!("{at}.telemetry");
    let Some(list) = list else {
        return Ok(default_sources(flavor, url, addresses));
    };
    if !addresses.http {
        if let Some(s) = list.iter().find(|s| *s == "http" || *s == "prometheus") {
            return Err(invalid(
                key,
                format!("{s:?} is read from the engine's url, and this engine has only grpc_url: use \"grpc://host:port\" or an explicit \"http://host:port/path\""),
            ));
        }
    }
    if list.is_empty() {
        return Err(invalid(key, "needs at least one source"));
    }
    let mut out = Vec::with_capacity(list.len());
    for s in list {
        let grpc = (s.strip_prefix("grpc://").map(|r| (r, false)))
            .or_else(|| s.strip_prefix("grpcs://").map(|r| (r, true)));
        let src = if let Some((rest, tls)) = grpc {
            if flavor == Flavor::Gateway {
                return Err(invalid(
                    key,
                    "a gateway is read through its HTTP /loads rollup, not gRPC",
                ));
            }
            let a: http::uri::Authority = rest
                .trim_end_matches('/')
                .parse()
                .map_err(|_| invalid(&key, format!("{s:?} has no valid host:port")))?;
            if a.port_u16().is_none() || a.as_str().contains('@') {
                return Err(invalid(&key, format!("{s:?} needs host:port and no '@'")));
            }
            TelemetrySource::Grpc {
                authority: a.as_str().into(),
                tls,
            }
        } else if s == "http" {
            match flavor {
                Flavor::Vllm => {
                    return Err(invalid(
                        key,
                        "vLLM serves no per-rank HTTP loads endpoint (its /load is one in-flight count); use grpc://... or prometheus",
                    ))
                }
                _ => match http_sources(flavor, url).into_iter().next() {
                    Some(src @ TelemetrySource::Http { .. }) => src,
                    _ => return Err(invalid(key, "no default HTTP loads endpoint for this flavor")),
                },
            }
        } else if s.starts_with("http://") || s.starts_with("https://") {
            if s.contains('@') {
                return Err(invalid(key, format!("{s:?} contains '@'")));
            }
            let _: http::Uri = s
                .parse()
                .map_err(|_| invalid(&key, format!("{s:?} is not a valid URL")))?;
            TelemetrySource::Http {
                url: s.as_str().into(),
            }
        } else if s == "prometheus" {
            if flavor == Flavor::Gateway {
                return Err(invalid(
                    key,
                    "a gateway's /metrics carries no per-rank KV; use its /loads (\"http\")",
                ));
            }
            TelemetrySource::Prometheus
        } else {
            return Err(invalid(
                key,
                format!("unknown source {s:?}: use \"grpc://host:port\", \"http\", \"http://host:port/path\" or \"prometheus\""),
            ));
        };
        if out.contains(&src) {
            return Err(invalid(key, format!("{s:?} is listed twice")));
        }
        out.push(src);
    }
    Ok(out)
}
