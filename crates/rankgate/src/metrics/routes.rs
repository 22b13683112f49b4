//! The `route` label: one of a fixed list (the route table, the front door's own endpoints,
//! `server.extra_routes`, the gRPC methods, and `unmatched`), indexed at startup, so whatever
//! paths clients send the series stay as many as the fleet has routes.

use crate::proto::{HEALTH_SERVICE, SGLANG_SERVICE, VLLM_SERVICE};

/// The `route` label of requests whose path is none of the known ones.
pub const UNMATCHED: &str = "unmatched";

/// The paths of the route table ([`crate::proxy::route::table`]); a unit test checks that each
/// is routed and that the table routes nothing else.
pub(crate) const TABLE_ROUTES: [&str; 24] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/rerank",
    "/v1/score",
    "/classify",
    "/tokenize",
    "/detokenize",
    "/rerank",
    "/v2/rerank",
    "/score",
    "/pooling",
    "/v1/messages",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/generate",
    "/encode",
    "/v1/classify",
    "/v1/tokenize",
    "/v1/detokenize",
    "/get_model_info",
    "/get_server_info",
    "/server_info",
];

/// Paths the front door answers itself, or refuses by prefix.
const OWN_ROUTES: [&str; 3] = ["/v1/models", "/v1/models/{id}", "/v1/responses/{id}"];

/// The gRPC methods of the engine services (see [`crate::proxy::grpc`]), and the health
/// service's.
const GRPC_METHODS: [&str; 9] = [
    "Generate",
    "Embed",
    "HealthCheck",
    "GetModelInfo",
    "GetServerInfo",
    "GetTokenizer",
    "Abort",
    "FlushCache",
    "GetLoads",
];
const HEALTH_METHODS: [&str; 2] = ["Check", "Watch"];

/// A request's `route` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RouteIdx(pub(super) u16);

/// Paths ordered by length first: most comparisons in a lookup then end on the lengths,
/// without comparing bytes.
fn by_length(a: &str, b: &str) -> std::cmp::Ordering {
    a.len().cmp(&b.len()).then_with(|| a.cmp(b))
}

/// Every route label, fixed at startup.
#[derive(Debug)]
pub struct Routes {
    /// Every name, indexed by [`RouteIdx`]: the HTTP paths, the gRPC paths, the extra routes,
    /// then `unmatched`.
    names: Vec<Box<str>>,
    /// Exact HTTP paths (table, `/v1/models`, extra), sorted [`by_length`], with their index.
    http: Vec<(Box<str>, RouteIdx)>,
    models_id: RouteIdx,
    responses_id: RouteIdx,
    /// Index of the first gRPC path; they are service-major, in [`GRPC_METHODS`] order.
    grpc: u16,
    unmatched: RouteIdx,
}

impl Routes {
    /// The route table's paths and `extra` (`server.extra_routes`).
    pub fn new(extra: &[String]) -> Routes {
        let mut names: Vec<Box<str>> = Vec::new();
        names.extend(TABLE_ROUTES.iter().map(|p| (*p).into()));
        names.extend(OWN_ROUTES.iter().map(|p| (*p).into()));
        let grpc = names.len() as u16;
        for service in [VLLM_SERVICE, SGLANG_SERVICE] {
            names.extend(
                GRPC_METHODS
                    .iter()
                    .map(|m| format!("/{service}/{m}").into()),
            );
        }
        names.extend(
            (HEALTH_METHODS.iter()).map(|m| format!("/{HEALTH_SERVICE}/{m}").into_boxed_str()),
        );
        for p in extra {
            if !names.iter().any(|n| **n == **p) {
                names.push(p.as_str().into());
            }
        }
        names.push(UNMATCHED.into());
        let idx =
            |name: &str| RouteIdx(names.iter().position(|n| &**n == name).unwrap_or(0) as u16);
        let mut http: Vec<(Box<str>, RouteIdx)> = (TABLE_ROUTES.iter().copied())
            .chain(["/v1/models"])
            .chain(extra.iter().map(String::as_str))
            .map(|p| (p.into(), idx(p)))
            .collect();
        http.sort_unstable_by(|a, b| by_length(&a.0, &b.0));
        http.dedup_by(|a, b| a.0 == b.0);
        Routes {
            models_id: idx("/v1/models/{id}"),
            responses_id: idx("/v1/responses/{id}"),
            unmatched: RouteIdx(names.len() as u16 - 1),
            grpc,
            http,
            names,
        }
    }

    /// The label of a request for `path` on the HTTP front door (`grpc`: the gRPC one).
    pub fn of(&self, grpc: bool, path: &str) -> RouteIdx {
        if grpc {
            return self.grpc_of(path).unwrap_or(self.unmatched);
        }
        if let Ok(i) = self.http.binary_search_by(|(p, _)| by_length(p, path)) {
            return self.http[i].1;
        }
        if path
            .strip_prefix("/v1/models/")
            .is_some_and(|id| !id.is_empty())
        {
            return self.models_id;
        }
        if path.starts_with("/v1/responses/") {
            return self.responses_id;
        }
        self.unmatched
    }

    fn grpc_of(&self, path: &str) -> Option<RouteIdx> {
        let (service, method) = path.strip_prefix('/')?.split_once('/')?;
        let n = GRPC_METHODS.len();
        let at = |s: usize, methods: &[&str]| {
            let m = methods.iter().position(|x| *x == method)?;
            Some(RouteIdx(self.grpc + (s * n + m) as u16))
        };
        match service {
            VLLM_SERVICE => at(0, &GRPC_METHODS),
            SGLANG_SERVICE => at(1, &GRPC_METHODS),
            HEALTH_SERVICE => at(2, &HEALTH_METHODS),
            _ => None,
        }
    }

    pub fn name(&self, r: RouteIdx) -> &str {
        self.names.get(r.0 as usize).map_or(UNMATCHED, |n| n)
    }

    pub fn unmatched(&self) -> RouteIdx {
        self.unmatched
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_table_route_is_routed_and_only_those() {
        for p in TABLE_ROUTES {
            assert!(crate::proxy::route::table(p).is_some(), "{p} is not routed");
        }
        // The table is a `match` on string literals: every path it routes is one of ours.
        let src = include_str!("../proxy/route.rs");
        let start = src.find("pub fn table(").unwrap();
        let end = start + src[start..].find("\n}\n").unwrap();
        let routed: Vec<&str> = src[start..end]
            .split('"')
            .skip(1)
            .step_by(2)
            .filter(|s| s.starts_with('/'))
            .collect();
        assert!(routed.len() >= TABLE_ROUTES.len(), "{routed:?}");
        for p in routed {
            assert!(TABLE_ROUTES.contains(&p), "route {p} has no label");
        }
        // Likewise the gRPC method table.
        let src = include_str!("../proxy/grpc/calls.rs");
        let start = src.find("fn call(").unwrap();
        let end = start + src[start..].find("\n}\n").unwrap();
        let methods: Vec<&str> = src[start..end].split('"').skip(1).step_by(2).collect();
        assert_eq!(methods.len(), GRPC_METHODS.len(), "{methods:?}");
        assert!(
            methods.iter().all(|m| GRPC_METHODS.contains(m)),
            "{methods:?}"
        );
    }

    #[test]
    fn routes_are_a_fixed_list_whatever_the_path() {
        let r = Routes::new(&["/v1/custom".into()]);
        let name = |grpc: bool, p: &str| r.name(r.of(grpc, p)).to_string();
        assert_eq!(name(false, "/v1/chat/completions"), "/v1/chat/completions");
        assert_eq!(name(false, "/v1/custom"), "/v1/custom");
        assert_eq!(name(false, "/v1/models"), "/v1/models");
        assert_eq!(name(false, "/v1/models/meta/llama"), "/v1/models/{id}");
        assert_eq!(name(false, "/v1/responses/resp_1"), "/v1/responses/{id}");
        assert_eq!(name(false, "/v1/chat/completions/x"), UNMATCHED);
        assert_eq!(name(false, "/anything"), UNMATCHED);
        let generate = format!("/{SGLANG_SERVICE}/Generate");
        assert_eq!(name(true, &generate), generate);
        assert_eq!(
            name(true, &format!("/{HEALTH_SERVICE}/Check")),
            format!("/{HEALTH_SERVICE}/Check")
        );
        assert_eq!(name(true, &format!("/{VLLM_SERVICE}/Nope")), UNMATCHED);
        assert_eq!(name(true, "/v1/chat/completions"), UNMATCHED);
    }
}
