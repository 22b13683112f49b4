//! `[[discovery]]`: where engines are found at runtime (DNS names, Kubernetes pods), and the
//! engine keys every engine found there gets. A found address becomes an `[[engines]]` entry
//! validated by the same rules as one written in the file.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::duration::HumanDuration;
use super::engine::{Engine, Flavor, RankNumbering, Role};
use super::engines::RawEngine;
use super::error::{invalid, ConfigError};

/// Default re-resolution interval of a DNS discovery.
pub const DEFAULT_DNS_INTERVAL: Duration = Duration::from_secs(5);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDiscovery {
    kind: Kind,
    // dns
    name: Option<String>,
    resolver: Option<String>,
    interval: Option<HumanDuration>,
    // kubernetes
    namespace: Option<String>,
    selector: Option<String>,
    kubeconfig: Option<PathBuf>,
    // both
    port: Option<PortRef>,
    grpc_port: Option<PortRef>,
    // the engine keys of what is found
    flavor: Option<Flavor>,
    dp_size: Option<u32>,
    dp_group: Option<String>,
    start_rank: Option<u32>,
    rank_header: Option<RankNumbering>,
    health_path: Option<String>,
    models: Option<Vec<String>>,
    api_key_env: Option<String>,
    /// The engines found are reached over TLS (`https://ip:port`, `[engine_tls]`).
    tls: Option<bool>,
    /// Their part in a disaggregated model (a pod's `rankgate.io/role` overrides it).
    role: Option<Role>,
    /// SGLang prefill servers' bootstrap port (a pod's `rankgate.io/bootstrap-port` overrides).
    bootstrap_port: Option<u16>,
    /// Their `--max-loras`.
    max_loras: Option<u32>,
    /// LoRA adapters each may hold loaded at once.
    max_adapters: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Kind {
    Dns,
    Kubernetes,
}

/// DP keys one finding gives for its engine (a pod's annotations), over the entry's.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub dp_size: Option<u32>,
    pub start_rank: Option<u32>,
    pub dp_group: Option<String>,
    /// The engine's name for clients (`server.expose_worker = "name"`): the pod's name. A DNS
    /// finding has none (one DNS name stands for all of its addresses).
    pub name: Option<String>,
    /// Its part in a disaggregated model (`rankgate.io/role`).
    pub role: Option<Role>,
    /// An SGLang prefill server's bootstrap port (`rankgate.io/bootstrap-port`).
    pub bootstrap_port: Option<u16>,
}

/// A container port: by number, or (Kubernetes) by its name in the pod spec.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum PortRef {
    Number(u16),
    Name(String),
}

/// One validated `[[discovery]]` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Discovery {
    /// `discovery[i]`: names the entry in logs and errors, and the engines it found.
    pub at: String,
    pub source: Source,
    pub template: EngineTemplate,
}

/// Where a discovery looks.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// Every A/AAAA address of `name` is an engine at `port` (and `grpc_port`).
    Dns {
        name: String,
        port: Option<u16>,
        grpc_port: Option<u16>,
        /// The DNS server asked (UDP); `None`: the system's (`/etc/resolv.conf`).
        resolver: Option<SocketAddr>,
        interval: Duration,
    },
    /// Every Ready pod matching `selector` in `namespace` is an engine at its container port.
    Kubernetes {
        namespace: String,
        selector: String,
        port: Option<PortRef>,
        grpc_port: Option<PortRef>,
        /// A kubeconfig file; `None`: in-cluster config, else `KUBECONFIG` / `~/.kube/config`.
        kubeconfig: Option<PathBuf>,
    },
}

/// The `[[engines]]` keys every engine a discovery finds gets; its address comes from the finding.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineTemplate {
    pub flavor: Option<Flavor>,
    pub dp_size: Option<u32>,
    pub dp_group: Option<String>,
    pub start_rank: Option<u32>,
    rank_header: Option<RankNumbering>,
    health_path: Option<String>,
    models: Option<Vec<String>>,
    api_key_env: Option<String>,
    tls: bool,
    role: Option<Role>,
    bootstrap_port: Option<u16>,
    max_loras: Option<u32>,
    max_adapters: Option<u32>,
}

impl EngineTemplate {
    /// The environment variable named for the engines' key, if any.
    pub fn api_key_env(&self) -> Option<&str> {
        self.api_key_env.as_deref()
    }

    /// The role of the engines found (a pod's `rankgate.io/role` may override it).
    pub fn role(&self) -> Role {
        self.role.unwrap_or_default()
    }

    /// The engine at `ip:port` (gRPC service at `ip:grpc_port`), with the DP keys the finding
    /// gives (pod annotations) over the entry's. `at` names the finding in errors, e.g.
    /// `discovery[0] pod vllm-0`.
    pub fn engine(
        &self,
        at: &str,
        ip: IpAddr,
        port: Option<u16>,
        grpc_port: Option<u16>,
        found: Overrides,
    ) -> Result<Engine, ConfigError> {
        let scheme = if self.tls { "https" } else { "http" };
        let url = |p: u16| format!("{scheme}://{}", SocketAddr::new(ip, p));
        RawEngine {
            url: port.map(url),
            name: found.name,
            grpc_url: grpc_port.map(url),
            flavor: self.flavor,
            dp_size: found.dp_size.or(self.dp_size),
            dp_group: found.dp_group.or_else(|| self.dp_group.clone()),
            start_rank: found.start_rank.or(self.start_rank),
            rank_header: self.rank_header,
            telemetry: None,
            health_path: self.health_path.clone(),
            models: self.models.clone(),
            api_key_env: self.api_key_env.clone(),
            // A found engine's events: its GET /kv_event_sources says where, and they come
            // from its own address.
            kv_events: None,
            kv_events_topic: None,
            kv_events_from: None,
            kv_replay: None,
            role: found.role.or(self.role),
            bootstrap_port: found.bootstrap_port.or(self.bootstrap_port),
            kv_lease: None,
            kv_hosts: None,
            max_loras: self.max_loras,
            max_adapters: self.max_adapters,
        }
        .validate(at)
    }
}

impl RawDiscovery {
    pub(super) fn validate(self, i: usize) -> Result<Discovery, ConfigError> {
        let at = format!("discovery[{i}]");
        let key = |k: &str| format!("{at}.{k}");
        let dns_keys = [
            ("name", self.name.is_some()),
            ("resolver", self.resolver.is_some()),
            ("interval", self.interval.is_some()),
        ];
        let kubernetes_keys = [
            ("namespace", self.namespace.is_some()),
            ("selector", self.selector.is_some()),
            ("kubeconfig", self.kubeconfig.is_some()),
        ];
        let foreign = match self.kind {
            Kind::Dns => kubernetes_keys,
            Kind::Kubernetes => dns_keys,
        };
        if let Some((k, _)) = foreign.iter().find(|(_, set)| *set) {
            return Err(invalid(
                key(k),
                format!("is not a key of kind = \"{}\"", self.kind.as_str()),
            ));
        }
        let port = self.port.clone();
        let grpc_port = self.grpc_port.clone();
        if port.is_none() && grpc_port.is_none() {
            return Err(invalid(
                at,
                "needs `port` (the engines' OpenAI HTTP port), `grpc_port`, or both",
            ));
        }
        let source = match self.kind {
            Kind::Dns => {
                let number = |k: &str, p: Option<PortRef>| {
                    match p {
                    None => Ok(None),
                    Some(PortRef::Number(0)) => Err(invalid(key(k), "must not be 0")),
                    Some(PortRef::Number(n)) => Ok(Some(n)),
                    Some(PortRef::Name(n)) => Err(invalid(
                        key(k),
                        format!("{n:?}: a DNS discovery needs a port number (names are for Kubernetes pods)"),
                    )),
                }
                };
                let name = self.name.clone().unwrap_or_default();
                if let Err(problem) = dns_name(&name) {
                    return Err(invalid(
                        key("name"),
                        format!("{name:?} {problem}: give a DNS name such as \"vllm.default.svc.cluster.local\""),
                    ));
                }
                let resolver = match &self.resolver {
                    None => None,
                    Some(r) => Some(r.parse::<SocketAddr>().map_err(|_| {
                        invalid(
                            key("resolver"),
                            format!("{r:?} is not an ip:port (the DNS server to ask, over UDP)"),
                        )
                    })?),
                };
                let interval = self.interval.map_or(DEFAULT_DNS_INTERVAL, |d| d.0);
                if interval < Duration::from_millis(100) || interval > Duration::from_secs(3600) {
                    return Err(invalid(key("interval"), "must be between 100ms and 1h"));
                }
                Source::Dns {
                    name,
                    port: number("port", port)?,
                    grpc_port: number("grpc_port", grpc_port)?,
                    resolver,
                    interval,
                }
            }
            #[cfg(not(feature = "kubernetes"))]
            Kind::Kubernetes => {
                return Err(invalid(
                    key("kind"),
                    "this rankgate was built without Kubernetes discovery: build it with `--features kubernetes` (the container image is), or use kind = \"dns\" on a headless Service",
                ))
            }
            #[cfg(feature = "kubernetes")]
            Kind::Kubernetes => {
                let namespace = self.namespace.clone().unwrap_or_default();
                if namespace.trim().is_empty() {
                    return Err(invalid(
                        key("namespace"),
                        "is required: the pods' namespace",
                    ));
                }
                let selector = self.selector.clone().unwrap_or_default();
                if selector.trim().is_empty() {
                    return Err(invalid(
                        key("selector"),
                        "is required: a label selector such as \"app=vllm\" (every pod of the namespace is rarely an engine)",
                    ));
                }
                for (k, p) in [("port", &port), ("grpc_port", &grpc_port)] {
                    match p {
                        Some(PortRef::Number(0)) => return Err(invalid(key(k), "must not be 0")),
                        Some(PortRef::Name(n)) if n.trim().is_empty() => {
                            return Err(invalid(key(k), "is an empty port name"))
                        }
                        _ => {}
                    }
                }
                Source::Kubernetes {
                    namespace,
                    selector,
                    port,
                    grpc_port,
                    kubeconfig: self.kubeconfig.clone(),
                }
            }
        };
        let template = EngineTemplate {
            flavor: self.flavor,
            dp_size: self.dp_size,
            dp_group: self.dp_group,
            start_rank: self.start_rank,
            rank_header: self.rank_header,
            health_path: self.health_path,
            models: self.models,
            api_key_env: self.api_key_env,
            tls: self.tls.unwrap_or(false),
            role: self.role,
            bootstrap_port: self.bootstrap_port,
            max_loras: self.max_loras,
            max_adapters: self.max_adapters,
        };
        // Every key of the template is checked now, on a stand-in address, so a bad one is a
        // config error at load and not a log line per finding.
        let (p, g) = match &source {
            Source::Dns {
                port, grpc_port, ..
            } => (*port, *grpc_port),
            Source::Kubernetes {
                port, grpc_port, ..
            } => (port.as_ref().map(|_| 1), grpc_port.as_ref().map(|_| 2)),
        };
        template.engine(
            &at,
            IpAddr::from([127, 0, 0, 1]),
            p,
            g,
            Overrides::default(),
        )?;
        Ok(Discovery {
            at,
            source,
            template,
        })
    }
}

/// Checks a DNS name by the rules of RFC 1035 as resolvers apply them: dot-separated labels of
/// 1 to 63 letters, digits, `-` or `_` (service names), not starting or ending with `-`, at most
/// 253 characters, an optional final dot.
fn dns_name(name: &str) -> Result<(), &'static str> {
    let bare = name.strip_suffix('.').unwrap_or(name);
    if bare.is_empty() || bare.len() > 253 {
        return Err("must be 1 to 253 characters");
    }
    for label in bare.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err("has an empty label or one over 63 characters");
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err("may hold only letters, digits, '-', '_' and dots");
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err("has a label starting or ending with '-'");
        }
    }
    Ok(())
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Dns => "dns",
            Kind::Kubernetes => "kubernetes",
        }
    }
}

#[cfg(test)]
mod tests;
