//! Where an engine's KV-cache events come from (`engines[].kv_events`), and the `[[models]]`
//! table: how rankgate turns a model's prompts into the token ids those events name.
//!
//! An endpoint is written as the engine's own `--kv-events-config` `endpoint` is, so an
//! operator copies it across, and it means what it means to the engine (vLLM's convention,
//! SGLang's too): `tcp://*:PORT` (or `0.0.0.0`, `::`) — the engine binds, rankgate connects to
//! the engine's host; a concrete host — the engine connects there, so rankgate binds it. DP rank
//! `r` publishes on `PORT + r` either way.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;

use serde::Deserialize;

use super::error::{invalid, ConfigError};

/// One engine's KV-event endpoint, as the engine's config writes it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvEndpoint {
    /// The host the engine connects to (rankgate binds it); `None` when the engine binds
    /// every address (`*`, `0.0.0.0`, `::`) and rankgate connects to the engine's host.
    pub host: Option<Arc<str>>,
    /// Rank 0's port (the engine's first DP rank: its `start_rank`); rank `r` adds `r`.
    pub port: u16,
}

impl KvEndpoint {
    /// Parses `tcp://HOST:PORT` (an IPv6 host in brackets). The error says what is wrong.
    pub fn parse(s: &str) -> Result<KvEndpoint, String> {
        let rest = s.trim().strip_prefix("tcp://").ok_or_else(|| {
            format!("{s:?}: only tcp://HOST:PORT endpoints are supported (as the engine's --kv-events-config writes them)")
        })?;
        let (host, port) = match rest.strip_prefix('[') {
            Some(v6) => {
                let (h, p) = v6
                    .split_once("]:")
                    .ok_or_else(|| format!("{s:?}: an IPv6 host is written [ADDR]:PORT"))?;
                (h, p)
            }
            None => rest
                .rsplit_once(':')
                .ok_or_else(|| format!("{s:?}: has no :PORT"))?,
        };
        let port: u16 = match port.parse() {
            Ok(p) if p > 0 => p,
            _ => {
                return Err(format!(
                    "{s:?}: port {port:?} is not a port number (1-65535)"
                ))
            }
        };
        if host.is_empty() || host.contains(['/', ' ', '@']) {
            return Err(format!(
                "{s:?}: host {host:?} is not a host name or address"
            ));
        }
        let host = match host {
            "*" | "0.0.0.0" | "::" => None,
            h => Some(h.into()),
        };
        Ok(KvEndpoint { host, port })
    }

    /// The port rank `offset` (counted from the engine's first rank) publishes on; `None` past
    /// the port range.
    pub fn port_of(&self, offset: u32) -> Option<u16> {
        u16::try_from(u32::from(self.port) + offset).ok()
    }
}

impl std::fmt::Display for KvEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.host.as_deref() {
            None => write!(f, "tcp://*:{}", self.port),
            Some(h) if h.contains(':') => write!(f, "tcp://[{h}]:{}", self.port),
            Some(h) => write!(f, "tcp://{h}:{}", self.port),
        }
    }
}

/// An engine's KV events as its entry says: where, which topic (empty: every message), and
/// whom else they may come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvents {
    /// `None`: the engine's `GET /kv_event_sources` says where.
    pub endpoint: Option<KvEndpoint>,
    pub topic: Arc<str>,
    /// Addresses besides its URL's whence its events may be published to an endpoint rankgate
    /// binds (`engines[].kv_events_from`).
    pub from: Vec<IpAddr>,
    /// The engine's replay socket (`engines[].kv_replay`, its `--kv-events-config`
    /// `replay_endpoint`): rank `r` at the port + `r`. `None`: as its `/kv_event_sources` says.
    pub replay: Option<KvEndpoint>,
}

/// Validates `engines[i].kv_events`, `kv_events_topic` and `kv_events_from`; `None` when none
/// is set.
pub(super) fn kv_events(
    at: &str,
    endpoint: Option<&str>,
    topic: Option<&str>,
    from: Option<&[String]>,
    dp_size: Option<u32>,
) -> Result<Option<Arc<KvEvents>>, ConfigError> {
    let from = kv_events_from(at, from)?;
    let Some(endpoint) = endpoint else {
        return match topic {
            Some(_) => Err(invalid(
                format!("{at}.kv_events_topic"),
                "names the topic of engines[].kv_events: set that too (or leave both out and rankgate asks the engine's GET /kv_event_sources)",
            )),
            None if from.is_empty() => Ok(None),
            None => Ok(Some(Arc::new(KvEvents {
                endpoint: None,
                topic: "".into(),
                from,
                replay: None,
            }))),
        };
    };
    let endpoint =
        KvEndpoint::parse(endpoint).map_err(|e| invalid(format!("{at}.kv_events"), e))?;
    if let Some(n) = dp_size {
        if endpoint.port_of(n.saturating_sub(1)).is_none() {
            return Err(invalid(
                format!("{at}.kv_events"),
                format!(
                    "rank r publishes on port + r, and {n} ranks from port {} pass 65535",
                    endpoint.port
                ),
            ));
        }
    }
    Ok(Some(Arc::new(KvEvents {
        endpoint: Some(endpoint),
        topic: topic.unwrap_or("").into(),
        from,
        replay: None,
    })))
}

/// Adds `engines[i].kv_replay` to the engine's KV-event settings: an endpoint as its
/// `--kv-events-config` `replay_endpoint` writes it (the engine binds it: `tcp://*:PORT`, or an
/// IP address of the engine's), rank `r` at the port + `r`.
pub(super) fn with_replay(
    at: &str,
    events: Option<Arc<KvEvents>>,
    replay: Option<&str>,
    dp_size: Option<u32>,
) -> Result<Option<Arc<KvEvents>>, ConfigError> {
    let Some(replay) = replay else {
        return Ok(events);
    };
    let bad = |why: String| invalid(format!("{at}.kv_replay"), why);
    let ep = KvEndpoint::parse(replay).map_err(bad)?;
    if let Some(h) = ep.host.as_deref() {
        if h.parse::<IpAddr>().is_err() {
            return Err(bad(format!(
                "{replay:?}: the engine binds its replay socket; give tcp://*:PORT or one of its IP addresses"
            )));
        }
    }
    if let Some(n) = dp_size {
        if ep.port_of(n.saturating_sub(1)).is_none() {
            return Err(bad(format!(
                "rank r replays on port + r, and {n} ranks from port {} pass 65535",
                ep.port
            )));
        }
    }
    let base = events.as_deref().cloned().unwrap_or(KvEvents {
        endpoint: None,
        topic: "".into(),
        from: Vec::new(),
        replay: None,
    });
    Ok(Some(Arc::new(KvEvents {
        replay: Some(ep),
        ..base
    })))
}

/// Validates `engines[i].kv_events_from`: IP addresses (an engine's publisher connects from an
/// address, not a name; a name could resolve to anyone's later).
fn kv_events_from(at: &str, from: Option<&[String]>) -> Result<Vec<IpAddr>, ConfigError> {
    (from.unwrap_or_default().iter().enumerate())
        .map(|(i, a)| {
            a.trim().parse::<IpAddr>().map_err(|_| {
                invalid(
                    format!("{at}.kv_events_from[{i}]"),
                    format!(
                        "{a:?} is not an IP address (the engine's publisher connects from one)"
                    ),
                )
            })
        })
        .collect()
}

/// One `[[models]]` entry as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawModel {
    name: Option<String>,
    tokenizer: Option<PathBuf>,
    chat_template: Option<PathBuf>,
    #[serde(default)]
    engine_tokenize: bool,
}

/// How rankgate tokenizes one model's prompts for exact prefix-cache routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    /// The model id requests name (`"model"`).
    pub name: Arc<str>,
    /// A directory with `tokenizer.json` (and `tokenizer_config.json`, a `chat_template.jinja`
    /// when the model has one), or the `tokenizer.json` file itself.
    pub tokenizer: Option<PathBuf>,
    /// A chat template file, over the one the tokenizer's directory holds.
    pub chat_template: Option<PathBuf>,
    /// Without a tokenizer: ask an engine serving the model (`POST /tokenize`), at the cost of
    /// a round trip on every request routed by it.
    pub engine_tokenize: bool,
}

/// Validates `[[models]]`.
pub(super) fn models(raw: Vec<RawModel>) -> Result<Vec<ModelConfig>, ConfigError> {
    let mut out: Vec<ModelConfig> = Vec::with_capacity(raw.len());
    for (i, m) in raw.into_iter().enumerate() {
        let at = format!("models[{i}]");
        let name = match m.name.as_deref().map(str::trim) {
            Some(n) if !n.is_empty() => n,
            _ => {
                return Err(invalid(
                    format!("{at}.name"),
                    "must name the model (the \"model\" requests give)",
                ))
            }
        };
        if let Some(j) = out.iter().position(|o| *o.name == *name) {
            return Err(invalid(
                format!("{at}.name"),
                format!("{name:?} is a duplicate of models[{j}]"),
            ));
        }
        if m.tokenizer.is_none() && !m.engine_tokenize {
            return Err(invalid(
                format!("{at}.tokenizer"),
                "is required (a directory with tokenizer.json), unless engine_tokenize = true",
            ));
        }
        if m.chat_template.is_some() && m.tokenizer.is_none() {
            return Err(invalid(
                format!("{at}.chat_template"),
                "goes with `tokenizer` (the engine's /tokenize applies its own template)",
            ));
        }
        out.push(ModelConfig {
            name: name.into(),
            tokenizer: m.tokenizer,
            chat_template: m.chat_template,
            engine_tokenize: m.engine_tokenize,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_read_as_the_engine_writes_them() {
        let e = KvEndpoint::parse("tcp://*:5557").unwrap();
        assert_eq!((e.host, e.port), (None, 5557));
        let e = KvEndpoint::parse("tcp://10.0.0.9:6000").unwrap();
        assert_eq!((e.host.as_deref(), e.port), (Some("10.0.0.9"), 6000));
        let e = KvEndpoint::parse("tcp://[fe80::1]:6000").unwrap();
        assert_eq!(e.host.as_deref(), Some("fe80::1"));
        assert_eq!(e.to_string(), "tcp://[fe80::1]:6000");
        assert_eq!(KvEndpoint::parse("tcp://0.0.0.0:1").unwrap().host, None);
        assert_eq!(KvEndpoint::parse("tcp://h:65535").unwrap().port_of(1), None);
    }

    #[test]
    fn bad_endpoints_say_what_is_wrong() {
        for (s, says) in [
            ("ipc:///tmp/kv", "only tcp://"),
            ("tcp://host", "no :PORT"),
            ("tcp://host:0", "not a port"),
            ("tcp://host:99999", "not a port"),
            ("tcp://:5557", "not a host"),
            ("tcp://[::1:5557", "[ADDR]:PORT"),
        ] {
            let e = KvEndpoint::parse(s).unwrap_err();
            assert!(e.contains(says), "{s}: {e}");
        }
    }

    #[test]
    fn a_topic_needs_an_endpoint_and_ranks_need_ports() {
        let e = kv_events("engines[0]", None, Some("kv"), None, None).unwrap_err();
        assert!(e.to_string().contains("engines[0].kv_events_topic"), "{e}");
        let e = kv_events("engines[0]", Some("tcp://*:65535"), None, None, Some(2)).unwrap_err();
        assert!(e.to_string().contains("pass 65535"), "{e}");
        let k = kv_events("engines[0]", Some("tcp://*:5557"), None, None, Some(2))
            .unwrap()
            .unwrap();
        assert_eq!(&*k.topic, "");
    }

    #[test]
    fn a_replay_endpoint_is_the_engines_to_bind() {
        assert_eq!(with_replay("e", None, None, None).unwrap(), None);
        let k = with_replay("e", None, Some("tcp://*:5657"), Some(2))
            .unwrap()
            .unwrap();
        assert_eq!(
            (k.endpoint.as_ref(), k.replay.as_ref().map(|r| r.port)),
            (None, Some(5657))
        );
        let e = with_replay("e", None, Some("tcp://engine.local:5657"), None).unwrap_err();
        assert!(e.to_string().contains("e.kv_replay"), "{e}");
        let e = with_replay("e", None, Some("tcp://*:65535"), Some(2)).unwrap_err();
        assert!(e.to_string().contains("pass 65535"), "{e}");
    }

    #[test]
    fn publishers_addresses_are_ip_addresses() {
        let ok = kv_events_from("engines[0]", Some(&["10.0.0.5".into(), " ::1 ".into()])).unwrap();
        assert_eq!(ok.len(), 2);
        assert!(kv_events_from("engines[0]", None).unwrap().is_empty());
        let e = kv_events_from(
            "engines[0]",
            Some(&["10.0.0.5".into(), "engine.local".into()]),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("engines[0].kv_events_from[1]"),
            "{e}"
        );
        assert!(e.to_string().contains("not an IP address"), "{e}"); // Alone: the engine's /kv_event_sources still says where, these say whom else to trust.
        let only = ["10.0.0.7".to_string()];
        let k = (kv_events("engines[0]", None, None, Some(&only), None).unwrap()).unwrap();
        assert_eq!((k.endpoint.as_ref(), k.from.len()), (None, 1));
    }

    #[test]
    fn models_need_a_name_and_a_way_to_tokenize() {
        let raw = |t: &str| -> Vec<RawModel> {
            #[derive(Deserialize)]
            struct W {
                models: Vec<RawModel>,
            }
            toml::from_str::<W>(t).unwrap().models
        };
        let m = models(raw("[[models]]\nname = \"m\"\ntokenizer = \"/t\"")).unwrap();
        assert_eq!(m[0].tokenizer.as_deref(), Some(std::path::Path::new("/t")));
        for (t, says) in [
            ("[[models]]\ntokenizer = \"/t\"", "models[0].name"),
            ("[[models]]\nname = \"m\"", "models[0].tokenizer"),
            ("[[models]]\nname = \"m\"\nengine_tokenize = true\nchat_template = \"/c\"", "models[0].chat_template"),
            ("[[models]]\nname = \"m\"\ntokenizer = \"/t\"\n[[models]]\nname = \"m\"\ntokenizer = \"/u\"", "duplicate of models[0]"),
        ] {
            let e = models(raw(t)).unwrap_err().to_string();
            assert!(e.contains(says), "{t}: {e}");
        }
    }
}
