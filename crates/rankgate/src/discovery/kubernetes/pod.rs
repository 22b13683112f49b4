//! A pod read as an engine: whether it is Ready, which ports and annotations it declares, and
//! why it is skipped when it cannot be one. Pure reading of one `Pod`; the watch lives in the
//! parent and the set of pods in `fleet`.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;

use crate::config::{EngineTemplate, Overrides, PortRef};
use crate::worker::Engine;

/// Pod annotation giving the engine's `dp_size` (else the entry's).
pub const DP_SIZE_ANNOTATION: &str = "rankgate.io/dp-size";
/// Pod annotation giving the engine's `start_rank` (else the entry's).
pub const START_RANK_ANNOTATION: &str = "rankgate.io/start-rank";
/// Pod annotation naming the multi-server DP deployment the pod's engine is a member of (else
/// the entry's `dp_group`).
pub const DP_GROUP_ANNOTATION: &str = "rankgate.io/dp-group";

/// Pod annotation giving the engine's part in a disaggregated model, `prefill` or `decode` (else
/// the entry's `role`).
pub const ROLE_ANNOTATION: &str = "rankgate.io/role";
/// Pod annotation giving an SGLang prefill server's bootstrap port (else the entry's).
pub const BOOTSTRAP_PORT_ANNOTATION: &str = "rankgate.io/bootstrap-port";

/// What one pod contributes now.
// Nearly every pod is an engine, so the size is the engine's anyway: boxing would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub(super) enum PodState {
    /// Ready, addressed and valid.
    Engine(Engine),
    /// Not Ready, being deleted or without an IP yet: nothing to serve, nothing to warn about.
    Waiting,
    /// Cannot be an engine as it is declared (warned about once).
    Skipped(Skip),
}

/// Why a pod is not an engine though it may be Ready.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum Skip {
    #[error("no container declares a port named {0:?}")]
    NoPort(String),
    #[error("container port {name:?} is {number}, not a port number")]
    BadPort { name: String, number: i32 },
    #[error("annotation {key}: {value:?} is not a whole number")]
    BadAnnotation { key: &'static str, value: String },
    #[error("annotation rankgate.io/role: {0:?} is none of prefill, decode, both")]
    BadRole(String),
    #[error("status.podIP {0:?} is not an IP address")]
    BadIp(String),
    /// The engine the pod would be fails the `[[engines]]` rules (e.g. `dp-size` 0).
    #[error("{0}")]
    Invalid(String),
}

/// Turns a pod into what it contributes, by the entry's ports and engine keys.
#[derive(Debug)]
pub(super) struct Projector {
    pub(super) at: String,
    pub(super) namespace: String,
    pub(super) port: Option<PortRef>,
    pub(super) grpc_port: Option<PortRef>,
    pub(super) template: EngineTemplate,
}

impl Projector {
    pub(super) fn project(&self, pod: &Pod) -> PodState {
        match self.try_project(pod) {
            Ok(Some(engine)) => PodState::Engine(engine),
            Ok(None) => PodState::Waiting,
            Err(skip) => PodState::Skipped(skip),
        }
    }

    /// What the spec declares is checked before readiness, so a mistake is reported when the
    /// pod appears, not when it is finally Ready and still missing from the fleet.
    fn try_project(&self, pod: &Pod) -> Result<Option<Engine>, Skip> {
        let port = self.port.as_ref().map(|p| port_of(pod, p)).transpose()?;
        let grpc_port = self
            .grpc_port
            .as_ref()
            .map(|p| port_of(pod, p))
            .transpose()?;
        let found = Overrides {
            dp_size: annotation(pod, DP_SIZE_ANNOTATION)?,
            start_rank: annotation(pod, START_RANK_ANNOTATION)?,
            dp_group: (pod.metadata.annotations.as_ref())
                .and_then(|a| a.get(DP_GROUP_ANNOTATION))
                .map(|g| g.trim().to_string()),
            // What clients may be told (`server.expose_worker = "name"`); a name that could
            // not be one is left out rather than the pod refused.
            name: (pod.metadata.name.clone()).filter(|n| crate::config::engine_name_ok(n)),
            role: role_annotation(pod)?,
            bootstrap_port: annotation(pod, BOOTSTRAP_PORT_ANNOTATION)?
                .map(|p| {
                    u16::try_from(p).map_err(|_| Skip::BadAnnotation {
                        key: BOOTSTRAP_PORT_ANNOTATION,
                        value: p.to_string(),
                    })
                })
                .transpose()?,
        };
        let Some(ip) = serving_ip(pod) else {
            return Ok(None);
        };
        let ip: IpAddr = ip.parse().map_err(|_| Skip::BadIp(ip.to_string()))?;
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let at = format!("{} pod {}/{name}", self.at, self.namespace);
        self.template
            .engine(&at, ip, port, grpc_port, found)
            .map(Some)
            .map_err(|e| Skip::Invalid(e.to_string()))
    }
}

/// The pod's IP when it should receive traffic: Ready (condition `Ready` is `True`) and not
/// being deleted (a terminating pod can stay Ready for its whole grace period while it drains).
fn serving_ip(pod: &Pod) -> Option<&str> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let ip = status.pod_ip.as_deref().filter(|ip| !ip.is_empty())?;
    ready.then_some(ip)
}

/// A port number as is, a port name through the pod's containers' declared ports.
fn port_of(pod: &Pod, port: &PortRef) -> Result<u16, Skip> {
    let name = match port {
        PortRef::Number(n) => return Ok(*n),
        PortRef::Name(name) => name,
    };
    let declared = pod
        .spec
        .iter()
        .flat_map(|s| &s.containers)
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some(name.as_str()))
        .ok_or_else(|| Skip::NoPort(name.clone()))?;
    u16::try_from(declared.container_port)
        .ok()
        .filter(|&n| n != 0)
        .ok_or_else(|| Skip::BadPort {
            name: name.clone(),
            number: declared.container_port,
        })
}

/// The role annotation; absent is `None` (the entry's role then applies).
fn role_annotation(pod: &Pod) -> Result<Option<crate::config::Role>, Skip> {
    use crate::config::Role;
    let annotations = pod.metadata.annotations.as_ref();
    let Some(value) = annotations.and_then(|a| a.get(ROLE_ANNOTATION)) else {
        return Ok(None);
    };
    match value.trim() {
        "prefill" => Ok(Some(Role::Prefill)),
        "decode" => Ok(Some(Role::Decode)),
        "both" => Ok(Some(Role::Both)),
        _ => Err(Skip::BadRole(value.clone())),
    }
}

/// A numeric annotation; absent is `None` (the entry's value then applies).
fn annotation(pod: &Pod, key: &'static str) -> Result<Option<u32>, Skip> {
    let Some(value) = pod.metadata.annotations.as_ref().and_then(|a| a.get(key)) else {
        return Ok(None);
    };
    value
        .trim()
        .parse()
        .map(Some)
        .map_err(|_| Skip::BadAnnotation {
            key,
            value: value.clone(),
        })
}

#[cfg(test)]
pub(super) mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::config::{Config, DiscoverySource as Source};

    pub(crate) fn entry(keys: &str) -> Projector {
        let c = Config::from_str(&format!(
            "[[discovery]]\nkind = \"kubernetes\"\nnamespace = \"llm\"\nselector = \"app=vllm\"\nflavor = \"vllm\"\n{keys}"
        ))
        .unwrap();
        let d = &c.discovery[0];
        let Source::Kubernetes {
            port, grpc_port, ..
        } = &d.source
        else {
            panic!("{d:?}")
        };
        Projector {
            at: d.at.clone(),
            namespace: "llm".into(),
            port: port.clone(),
            grpc_port: grpc_port.clone(),
            template: d.template.clone(),
        }
    }

    pub(crate) fn pod(name: &str, ready: bool, ip: &str, annotations: &[(&str, &str)]) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name,
                "namespace": "llm",
                "annotations": annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<HashMap<_, _>>(),
            },
            "spec": { "containers": [
                { "name": "sidecar", "ports": [{ "name": "metrics", "containerPort": 9090 }] },
                { "name": "engine", "ports": [
                    { "name": "http", "containerPort": 8000 },
                    { "name": "grpc", "containerPort": 50051 },
                ]},
            ]},
            "status": {
                "podIP": ip,
                "conditions": [
                    { "type": "PodScheduled", "status": "True" },
                    { "type": "Ready", "status": if ready { "True" } else { "False" } },
                ],
            },
        }))
        .unwrap()
    }

    fn engine(state: PodState) -> Engine {
        match state {
            PodState::Engine(e) => e,
            s => panic!("{s:?}"),
        }
    }

    #[test]
    fn a_ready_pod_is_an_engine_at_its_named_ports() {
        let p = entry("port = \"http\"\ngrpc_port = \"grpc\"\ndp_size = 2");
        let e = engine(p.project(&pod("vllm-0", true, "127.0.0.7", &[])));
        assert_eq!(&*e.url, "http://127.0.0.7:8000");
        assert_eq!(e.grpc.as_deref(), Some("127.0.0.7:50051"));
        assert_eq!((e.dp_size, e.start_rank), (2, 0));
        // A number is used as is, declared or not.
        let p = entry("port = 8123");
        let e = engine(p.project(&pod("vllm-0", true, "fd00::7", &[])));
        assert_eq!(&*e.url, "http://[fd00::7]:8123");
    }

    #[test]
    fn readiness_deletion_and_ip_decide() {
        let p = entry("port = \"http\"");
        assert_eq!(
            p.project(&pod("a", false, "127.0.0.7", &[])),
            PodState::Waiting
        );
        assert_eq!(p.project(&pod("a", true, "", &[])), PodState::Waiting);
        let mut no_status = pod("a", true, "127.0.0.7", &[]);
        no_status.status = None;
        assert_eq!(p.project(&no_status), PodState::Waiting);
        let mut deleting = pod("a", true, "127.0.0.7", &[]);
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2025-01-01T00:00:00Z".parse().unwrap(),
            ));
        assert_eq!(p.project(&deleting), PodState::Waiting);
        assert_eq!(
            p.project(&pod("a", true, "not-an-ip", &[])),
            PodState::Skipped(Skip::BadIp("not-an-ip".into()))
        );
    }

    #[test]
    fn annotations_override_the_entry() {
        let p = entry("port = \"http\"\ndp_size = 2\nstart_rank = 0");
        let e = engine(p.project(&pod(
            "a",
            true,
            "127.0.0.7",
            &[(DP_SIZE_ANNOTATION, "8"), (START_RANK_ANNOTATION, " 16 ")],
        )));
        assert_eq!((e.dp_size, e.start_rank), (8, 16));
        // The members of one deployment spread over pods name it.
        let e = engine(p.project(&pod(
            "a",
            true,
            "127.0.0.7",
            &[
                (START_RANK_ANNOTATION, "2"),
                (DP_GROUP_ANNOTATION, " llama "),
            ],
        )));
        assert_eq!(
            e.deployment,
            crate::worker::Deployment::Member {
                group: Some("llama".into())
            }
        );
        assert_eq!(
            p.project(&pod(
                "a",
                true,
                "127.0.0.7",
                &[(DP_SIZE_ANNOTATION, "eight")]
            )),
            PodState::Skipped(Skip::BadAnnotation {
                key: DP_SIZE_ANNOTATION,
                value: "eight".into()
            })
        );
        // Parsed, but not a valid engine: the `[[engines]]` rules name the pod.
        match p.project(&pod("a", true, "127.0.0.7", &[(DP_SIZE_ANNOTATION, "0")])) {
            PodState::Skipped(Skip::Invalid(why)) => {
                assert!(why.contains("discovery[0] pod llm/a"), "{why}")
            }
            s => panic!("{s:?}"),
        }
        // A bad annotation is reported before the pod is even Ready.
        assert!(matches!(
            p.project(&pod("a", false, "", &[(START_RANK_ANNOTATION, "-1")])),
            PodState::Skipped(Skip::BadAnnotation { .. })
        ));
    }

    #[test]
    fn role_annotations_override_the_entry_and_a_bad_one_skips_the_pod() {
        use crate::config::Role;
        let p = entry("port = \"http\"\ndp_size = 1\nrole = \"decode\"");
        let e = engine(p.project(&pod("d", true, "127.0.0.7", &[])));
        assert_eq!((e.role, e.bootstrap_port), (Role::Decode, None));
        let e = engine(p.project(&pod(
            "p",
            true,
            "127.0.0.7",
            &[(ROLE_ANNOTATION, " prefill ")],
        )));
        assert_eq!(e.role, Role::Prefill);
        let e = engine(p.project(&pod("w", true, "127.0.0.7", &[(ROLE_ANNOTATION, "both")])));
        assert_eq!(e.role, Role::Both);
        // A value that is no role: the pod is skipped, and the message names the annotation
        // and the roles there are.
        let skipped = p.project(&pod(
            "x",
            true,
            "127.0.0.7",
            &[(ROLE_ANNOTATION, "Prefill")],
        ));
        assert_eq!(skipped, PodState::Skipped(Skip::BadRole("Prefill".into())));
        let PodState::Skipped(why) = skipped else {
            unreachable!()
        };
        assert_eq!(
            why.to_string(),
            "annotation rankgate.io/role: \"Prefill\" is none of prefill, decode, both"
        );
        // The bootstrap port annotation: a vLLM prefill server has none, so the pod that
        // names one is skipped by the `[[engines]]` rule; a number out of range is named.
        let annotated = [
            (ROLE_ANNOTATION, "prefill"),
            (BOOTSTRAP_PORT_ANNOTATION, "9000"),
        ];
        match p.project(&pod("p", true, "127.0.0.7", &annotated)) {
            PodState::Skipped(Skip::Invalid(why)) => {
                assert!(
                    why.contains("discovery[0] pod llm/p.bootstrap_port"),
                    "{why}"
                )
            }
            s => panic!("{s:?}"),
        }
        let far = [
            (ROLE_ANNOTATION, "prefill"),
            (BOOTSTRAP_PORT_ANNOTATION, "70000"),
        ];
        assert_eq!(
            p.project(&pod("p", true, "127.0.0.7", &far)),
            PodState::Skipped(Skip::BadAnnotation {
                key: BOOTSTRAP_PORT_ANNOTATION,
                value: "70000".into()
            })
        );
    }

    #[test]
    fn an_sglang_prefill_pod_takes_its_bootstrap_port_from_the_annotation() {
        let c = Config::from_str(
            "[[discovery]]\nkind = \"kubernetes\"\nnamespace = \"llm\"\nselector = \"app=sglang\"\nflavor = \"sglang\"\nport = \"http\"\ndp_size = 1\nrole = \"prefill\"\n",
        )
        .unwrap();
        let mut p = entry("port = \"http\"");
        p.template = c.discovery[0].template.clone();
        let e = engine(p.project(&pod("p", true, "127.0.0.7", &[])));
        assert_eq!(e.bootstrap_port, Some(crate::config::SGLANG_BOOTSTRAP_PORT));
        let e = engine(p.project(&pod(
            "p",
            true,
            "127.0.0.7",
            &[(BOOTSTRAP_PORT_ANNOTATION, "9100")],
        )));
        assert_eq!(e.bootstrap_port, Some(9100));
    }

    #[test]
    fn a_missing_port_name_skips_the_pod() {
        let p = entry("port = \"openai\"");
        assert_eq!(
            p.project(&pod("a", true, "127.0.0.7", &[])),
            PodState::Skipped(Skip::NoPort("openai".into()))
        );
    }
}
