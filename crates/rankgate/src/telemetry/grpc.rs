//! gRPC `GetLoads` clients for vLLM and SGLang engines, over rankgate's own pooled h2 client
//! (h2c, or TLS).
//!
//! One unfiltered `GetLoads` per engine per poll returns every rank; the reply is converted into
//! the shared [`LoadsReport`] and projected like any other load report.

use std::time::Duration;

use crate::proto::{sglang, vllm};
use crate::wire::{Aggregate, LoadsReport, RankLoad};
use crate::worker::Flavor;

pub type Transport = crate::http::HttpClient<tonic::body::Body>;

/// A `GetLoads` client for one engine.
#[derive(Clone)]
pub enum LoadsClient {
    Vllm(vllm::vllm_engine_client::VllmEngineClient<Transport>),
    Sglang(sglang::sglang_scheduler_client::SglangSchedulerClient<Transport>),
}

/// [`transport_with`] trusting the system's roots.
pub fn transport(connect_timeout: Duration) -> Transport {
    crate::http::h2_client(connect_timeout)
}

/// An h2 client for gRPC: h2c to `http://` engines, TLS to `https://` ones.
pub fn transport_with(connect_timeout: Duration, tls: &crate::tls::Upstream) -> Transport {
    crate::http::h2_client_with(connect_timeout, tls)
}

/// What a `GetLoads` call should ask for.
pub fn request(dp_rank: Option<i32>) -> (Option<i32>, Vec<String>) {
    (dp_rank, vec!["core".to_string()])
}

impl LoadsClient {
    /// A client for `flavor`'s service at `origin` (`http://host:port`, or `https://` over
    /// TLS). An error for a gateway, which has no gRPC load service.
    pub fn new(flavor: Flavor, origin: &str, transport: Transport) -> Result<LoadsClient, String> {
        let origin: http::Uri =
            (origin.parse()).map_err(|e| format!("gRPC address {origin:?}: {e}"))?;
        match flavor {
            Flavor::Vllm => Ok(LoadsClient::Vllm(
                vllm::vllm_engine_client::VllmEngineClient::with_origin(transport, origin),
            )),
            Flavor::Sglang => Ok(LoadsClient::Sglang(
                sglang::sglang_scheduler_client::SglangSchedulerClient::with_origin(
                    transport, origin,
                ),
            )),
            Flavor::Gateway => Err("a gateway has no gRPC load service".into()),
        }
    }

    /// One `GetLoads` for every rank (or one rank, with `dp_rank`).
    pub async fn get_loads(&self, dp_rank: Option<i32>) -> Result<LoadsReport, String> {
        let (dp_rank, include) = request(dp_rank);
        let status = |s: tonic::Status| format!("GetLoads: {}: {}", s.code(), s.message());
        match self.clone() {
            LoadsClient::Vllm(mut c) => {
                let r = c
                    .get_loads(vllm::GetLoadsRequest { dp_rank, include })
                    .await
                    .map_err(status)?
                    .into_inner();
                Ok(LoadsReport {
                    dp_rank_count: Some(r.dp_rank_count as i64),
                    loads: r.loads.iter().map(from_vllm).collect(),
                    aggregate: None,
                })
            }
            LoadsClient::Sglang(mut c) => {
                let r = c
                    .get_loads(sglang::GetLoadsRequest { dp_rank, include })
                    .await
                    .map_err(status)?
                    .into_inner();
                Ok(LoadsReport {
                    dp_rank_count: Some(r.dp_rank_count as i64),
                    loads: r.loads.iter().map(from_sglang).collect(),
                    aggregate: r.aggregate.map(|a| Aggregate {
                        total_running_reqs: Some(a.total_running_reqs as i64),
                        total_waiting_reqs: Some(a.total_waiting_reqs as i64),
                        avg_token_usage: Some(a.avg_token_usage),
                    }),
                })
            }
        }
    }

    /// vLLM's `GetServerInfo.data_parallel_size`, to check the configured `dp_size` against.
    pub async fn data_parallel_size(&self) -> Option<i32> {
        match self.clone() {
            LoadsClient::Vllm(mut c) => c
                .get_server_info(vllm::GetServerInfoRequest {})
                .await
                .ok()
                .map(|r| r.into_inner().data_parallel_size),
            LoadsClient::Sglang(_) => None,
        }
    }

    /// Warns once when the engine says it runs fewer DP ranks than the config gives it.
    pub(super) async fn check_dp_size(&self, engine: &crate::worker::Engine) {
        if let Some(n) = self.data_parallel_size().await {
            let end = engine.start_rank + engine.dp_size;
            if n > 0 && (n as u32) < end {
                tracing::warn!(
                    engine = %engine.url, server_dp_size = n, configured_end_rank = end,
                    "engine reports fewer DP ranks than the config assigns it"
                );
            }
        }
    }
}

// The two services' entries differ only in one field number, so the conversions read alike.
macro_rules! entry_from {
    ($name:ident, $ty:ty) => {
        fn $name(l: &$ty) -> RankLoad {
            RankLoad {
                dp_rank: Some(l.dp_rank as i64),
                num_running_reqs: Some(l.num_running_reqs as i64),
                num_waiting_reqs: Some(l.num_waiting_reqs as i64),
                num_used_tokens: Some(l.num_used_tokens as i64),
                max_total_num_tokens: Some(l.max_total_num_tokens as i64),
                token_usage: Some(l.token_usage),
                gen_throughput: Some(l.gen_throughput),
                utilization: Some(l.utilization),
                ..RankLoad::default()
            }
        }
    };
}
entry_from!(from_vllm, vllm::SchedulerLoad);
entry_from!(from_sglang, sglang::SchedulerLoad);

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn explicit_rank_zero_filter_is_on_the_wire() {
        let (dp_rank, include) = request(Some(0));
        let with_zero = vllm::GetLoadsRequest {
            dp_rank,
            include: vec![],
        }
        .encode_to_vec();
        // Field 1, varint, value 0: present, not elided like a plain proto3 zero.
        assert_eq!(with_zero, [0x08, 0x00]);
        assert!(vllm::GetLoadsRequest {
            dp_rank: None,
            include: vec![]
        }
        .encode_to_vec()
        .is_empty());
        assert_eq!(include, ["core"]);
    }

    #[test]
    fn field_numbers_match_the_wire_contract() {
        let l = sglang::SchedulerLoad {
            num_waiting_uncached_tokens: 1,
            ..Default::default()
        };
        // SGLang numbers num_waiting_uncached_tokens 17 (tag 17<<3 = 136 = 0x88 0x01).
        assert_eq!(l.encode_to_vec(), [0x88, 0x01, 0x01]);
        let v = vllm::SchedulerLoad {
            num_waiting_uncached_tokens: 1,
            ..Default::default()
        };
        assert_eq!(v.encode_to_vec(), [12 << 3, 0x01]);
        let t = vllm::SchedulerLoad {
            token_usage: 0.5,
            ..Default::default()
        };
        assert_eq!(t.encode_to_vec()[0], (7 << 3) | 1);
        let info = vllm::GetServerInfoResponse {
            data_parallel_size: 2,
            ..Default::default()
        };
        assert_eq!(info.encode_to_vec(), [9 << 3, 0x02]);
    }
}
