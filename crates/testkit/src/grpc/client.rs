//! One flavor-neutral gRPC [`Client`] over the generated tonic clients of vLLM's `VllmEngine` and
//! SGLang's `SglangScheduler`: a `Generate` read as events ([`Gen`], [`Ev`]), `Embed`, `GetLoads`,
//! `Abort`, Health, and the worker that served a call.

use std::net::SocketAddr;
use std::time::Duration;

use prost::Message;
use rankgate::proto::{sglang, vllm};
use rankgate::telemetry::grpc::{transport, Transport};
use rankgate_sim::sim::SimFlavor as Flavor;
use tonic::{Status, Streaming};

use super::{bounded, sglang_embed, sglang_generate, vllm_embed, vllm_generate};

pub enum Client {
    Vllm(vllm::vllm_engine_client::VllmEngineClient<Transport>),
    Sglang(sglang::sglang_scheduler_client::SglangSchedulerClient<Transport>),
}

/// A generation event, whichever flavor framed it.
#[derive(Debug, PartialEq)]
pub enum Ev {
    Chunk { completion: u32 },
    Complete { reason: String, tokens: usize },
}

pub enum Gen {
    Vllm(Streaming<vllm::GenerateResponse>),
    Sglang(Streaming<sglang::GenerateResponse>),
}

impl Gen {
    /// The next event; `None` once the stream ended with status OK (any other status panics).
    pub async fn next(&mut self) -> Option<Ev> {
        self.try_next().await.expect("stream")
    }

    /// The next event; `Ok(None)` once the stream ended with status OK, `Err` with any other
    /// status (in the trailers, or a transport error as tonic reports it).
    pub async fn try_next(&mut self) -> Result<Option<Ev>, Status> {
        Ok(match self {
            Gen::Vllm(s) => {
                let Some(m) = bounded(s.message()).await? else {
                    return Ok(None);
                };
                Some(match m.response.expect("a response") {
                    vllm::generate_response::Response::Chunk(c) => Ev::Chunk {
                        completion: c.completion_tokens,
                    },
                    vllm::generate_response::Response::Complete(c) => Ev::Complete {
                        reason: c.finish_reason,
                        tokens: c.output_ids.len(),
                    },
                })
            }
            Gen::Sglang(s) => {
                let Some(m) = bounded(s.message()).await? else {
                    return Ok(None);
                };
                Some(match m.response.expect("a response") {
                    sglang::generate_response::Response::Chunk(c) => Ev::Chunk {
                        completion: c.completion_tokens,
                    },
                    sglang::generate_response::Response::Complete(c) => Ev::Complete {
                        reason: c.finish_reason,
                        tokens: c.output_ids.len(),
                    },
                    sglang::generate_response::Response::Error(e) => panic!("error {e:?}"),
                })
            }
        })
    }

    /// Every event until the stream ends (at most `limit`, or it panics).
    pub async fn all(&mut self, limit: usize) -> Vec<Ev> {
        let mut events = Vec::new();
        while let Some(ev) = self.next().await {
            events.push(ev);
            assert!(events.len() <= limit, "too many events: {events:?}");
        }
        events
    }

    /// Skips chunks until the final message: its finish reason and token count (`None`: the
    /// stream ended without one). Bounded by the per-message timeout and 10k chunks.
    pub async fn until_complete(&mut self) -> Option<(String, usize)> {
        for _ in 0..10_000 {
            match self.next().await? {
                Ev::Chunk { .. } => {}
                Ev::Complete { reason, tokens } => return Some((reason, tokens)),
            }
        }
        panic!("no final message within 10000 chunks");
    }
}

/// A generation as started: its stream, the request message as encoded by the client, and the
/// `x-rankgate-worker` response metadata (when rankgate answered).
pub struct Started {
    pub stream: Gen,
    pub raw: Vec<u8>,
    pub worker: Option<String>,
}

/// What `GetLoads` answered: `dp_rank_count` and per entry `(dp_rank, token_usage)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Loads {
    pub dp_rank_count: i32,
    pub ranks: Vec<(i32, f64)>,
}

fn worker_of(m: &tonic::metadata::MetadataMap) -> Option<String> {
    m.get("x-rankgate-worker")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

impl Client {
    /// A client of `flavor`'s service at `addr` (an engine's gRPC side or rankgate's).
    pub fn connect(flavor: Flavor, addr: SocketAddr) -> Client {
        let origin: http::Uri = format!("http://{addr}").parse().unwrap();
        let t = transport(Duration::from_secs(2));
        match flavor {
            Flavor::Vllm => Client::Vllm(vllm::vllm_engine_client::VllmEngineClient::with_origin(
                t, origin,
            )),
            Flavor::Sglang => Client::Sglang(
                sglang::sglang_scheduler_client::SglangSchedulerClient::with_origin(t, origin),
            ),
        }
    }

    pub fn flavor(&self) -> Flavor {
        match self {
            Client::Vllm(_) => Flavor::Vllm,
            Client::Sglang(_) => Flavor::Sglang,
        }
    }

    /// Starts a streaming generation; returns the stream, the request's encoded bytes and the
    /// worker metadata.
    pub async fn start(
        &mut self,
        id: &str,
        rank: Option<i32>,
        max: u32,
    ) -> Result<Started, Status> {
        match self {
            Client::Vllm(c) => {
                let req = vllm_generate(id, rank, max);
                let raw = req.encode_to_vec();
                let resp = bounded(c.generate(tonic::Request::new(req))).await?;
                Ok(Started {
                    worker: worker_of(resp.metadata()),
                    stream: Gen::Vllm(resp.into_inner()),
                    raw,
                })
            }
            Client::Sglang(c) => {
                let req = sglang_generate(id, rank, max);
                let raw = req.encode_to_vec();
                let resp = bounded(c.generate(tonic::Request::new(req))).await?;
                Ok(Started {
                    worker: worker_of(resp.metadata()),
                    stream: Gen::Sglang(resp.into_inner()),
                    raw,
                })
            }
        }
    }

    /// Starts a streaming generation; returns the stream and the request's encoded bytes.
    pub async fn generate(
        &mut self,
        id: &str,
        rank: Option<i32>,
        max: u32,
    ) -> Result<(Gen, Vec<u8>), Status> {
        let s = self.start(id, rank, max).await?;
        Ok((s.stream, s.raw))
    }

    /// One embedding (the rank is sent by SGLang only: vLLM's request has no rank); its dimension.
    pub async fn embed(&mut self, id: &str, rank: i32) -> Result<usize, Status> {
        match self {
            Client::Vllm(c) => {
                let r = bounded(c.embed(vllm_embed(id))).await?.into_inner();
                assert_eq!(r.embedding_dim as usize, r.embedding.len());
                Ok(r.embedding.len())
            }
            Client::Sglang(c) => {
                let r = bounded(c.embed(sglang_embed(id, rank))).await?.into_inner();
                assert_eq!(r.request_id, id);
                match r.response.expect("a response") {
                    sglang::embed_response::Response::Complete(c) => {
                        assert_eq!(c.embedding_dim as usize, c.embedding.len());
                        assert_eq!(c.prompt_tokens, 3);
                        Ok(c.embedding.len())
                    }
                    sglang::embed_response::Response::Error(e) => panic!("error {e:?}"),
                }
            }
        }
    }

    /// Aborts `id`. Returns SGLang's `AbortResponse.success` (vLLM's answer has no field: `None`).
    pub async fn abort(&mut self, id: &str) -> Result<Option<bool>, Status> {
        match self {
            Client::Vllm(c) => {
                let req = vllm::AbortRequest {
                    request_ids: vec![id.into()],
                };
                bounded(c.abort(req)).await?;
                Ok(None)
            }
            Client::Sglang(c) => {
                let req = sglang::AbortRequest {
                    request_id: id.into(),
                    reason: String::new(),
                };
                Ok(Some(bounded(c.abort(req)).await?.into_inner().success))
            }
        }
    }

    /// `GetLoads`, for every rank or only `dp_rank`.
    pub async fn get_loads(&mut self, dp_rank: Option<i32>) -> Result<Loads, Status> {
        match self {
            Client::Vllm(c) => {
                let req = vllm::GetLoadsRequest {
                    dp_rank,
                    include: vec![],
                };
                let r = bounded(c.get_loads(req)).await?.into_inner();
                Ok(Loads {
                    dp_rank_count: r.dp_rank_count,
                    ranks: r.loads.iter().map(|l| (l.dp_rank, l.token_usage)).collect(),
                })
            }
            Client::Sglang(c) => {
                let req = sglang::GetLoadsRequest {
                    dp_rank,
                    include: vec![],
                };
                let r = bounded(c.get_loads(req)).await?.into_inner();
                Ok(Loads {
                    dp_rank_count: r.dp_rank_count,
                    ranks: r.loads.iter().map(|l| (l.dp_rank, l.token_usage)).collect(),
                })
            }
        }
    }
}
