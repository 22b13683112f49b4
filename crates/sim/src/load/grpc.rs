//! The load client's gRPC side: streaming `Generate` calls on an engine's gRPC service (or
//! rankgate's gRPC front door, which serves the same services), timed like the HTTP side: time
//! to the first chunk, the gaps between chunks, and the worker named by `x-rankgate-worker` in
//! the response's initial metadata.

use std::time::Duration;

use tokio::time::Instant;
use tonic::{Code, Status};

use super::{ErrorKind, Outcome};
use rankgate::proto::{sglang, vllm};
use rankgate::telemetry::grpc::{transport, Transport};
use rankgate::worker::Flavor;

/// A client for one flavor's service at one address.
#[derive(Clone)]
pub enum GrpcClient {
    Vllm(vllm::vllm_engine_client::VllmEngineClient<Transport>),
    Sglang(sglang::sglang_scheduler_client::SglangSchedulerClient<Transport>),
}

/// What one `Generate` asks for.
#[derive(Debug, Clone)]
pub struct GenerateCall {
    pub request_id: String,
    /// The prompt as this many token ids (the simulated engine prefills by their count).
    pub prompt_tokens: u64,
    pub max_tokens: u32,
    /// A rank to pin (rankgate replaces it with its own pick).
    pub rank: Option<i32>,
    /// rankgate's admin token: the call asks (`x-rankgate-debug`) which rank served it.
    pub admin_token: Option<std::sync::Arc<str>>,
}

/// One message of a generation stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Tokens so far.
    Chunk { completion: u32 },
    /// The end: why, and the tokens generated.
    Complete { reason: String, tokens: usize },
}

/// A generation under way.
pub struct Generation {
    /// The `x-rankgate-worker` metadata, when rankgate answered.
    pub worker: Option<String>,
    stream: Stream,
}

enum Stream {
    Vllm(tonic::Streaming<vllm::GenerateResponse>),
    Sglang(tonic::Streaming<sglang::GenerateResponse>),
}

impl Generation {
    /// The next event; `Ok(None)` when the stream has ended.
    pub async fn next(&mut self) -> Result<Option<Event>, Status> {
        let missing = || Status::internal("a GenerateResponse without a response");
        Ok(Some(match &mut self.stream {
            Stream::Vllm(s) => {
                let Some(m) = s.message().await? else {
                    return Ok(None);
                };
                use vllm::generate_response::Response as R;
                match m.response.ok_or_else(missing)? {
                    R::Chunk(c) => Event::Chunk {
                        completion: c.completion_tokens,
                    },
                    R::Complete(c) => Event::Complete {
                        reason: c.finish_reason,
                        tokens: c.output_ids.len(),
                    },
                }
            }
            Stream::Sglang(s) => {
                let Some(m) = s.message().await? else {
                    return Ok(None);
                };
                use sglang::generate_response::Response as R;
                match m.response.ok_or_else(missing)? {
                    R::Chunk(c) => Event::Chunk {
                        completion: c.completion_tokens,
                    },
                    R::Complete(c) => Event::Complete {
                        reason: c.finish_reason,
                        tokens: c.output_ids.len(),
                    },
                    R::Error(e) => return Err(Status::internal(e.message)),
                }
            }
        }))
    }
}

impl GrpcClient {
    /// A client for `flavor`'s service at `url` (`http://host:port`).
    pub fn new(flavor: Flavor, url: &str) -> Result<GrpcClient, String> {
        Self::with_transport(flavor, url, transport(Duration::from_secs(2)))
    }

    /// The same over `t` (e.g. one trusting a private CA, for an `https://` front door).
    pub fn with_transport(flavor: Flavor, url: &str, t: Transport) -> Result<GrpcClient, String> {
        let origin: http::Uri = url
            .parse()
            .map_err(|e| format!("gRPC address {url:?}: {e}"))?;
        match flavor {
            Flavor::Vllm => Ok(GrpcClient::Vllm(
                vllm::vllm_engine_client::VllmEngineClient::with_origin(t, origin),
            )),
            Flavor::Sglang => Ok(GrpcClient::Sglang(
                sglang::sglang_scheduler_client::SglangSchedulerClient::with_origin(t, origin),
            )),
            Flavor::Gateway => Err("a gateway has no gRPC generation service".into()),
        }
    }

    /// Starts a streaming generation.
    pub async fn generate(&mut self, call: &GenerateCall) -> Result<Generation, Status> {
        let ids: Vec<u32> = (0..call.prompt_tokens).map(|i| 1000 + i as u32).collect();
        let worker = |m: &tonic::metadata::MetadataMap| {
            m.get("x-rankgate-worker")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        match self {
            GrpcClient::Vllm(c) => {
                let req = vllm::GenerateRequest {
                    request_id: call.request_id.clone(),
                    input: Some(vllm::generate_request::Input::Tokenized(
                        vllm::TokenizedInput {
                            original_text: String::new(),
                            input_ids: ids,
                        },
                    )),
                    sampling_params: Some(vllm::SamplingParams {
                        max_tokens: Some(call.max_tokens),
                    }),
                    stream: true,
                    data_parallel_rank: call.rank,
                };
                let resp = c.generate(debugged(req, call)?).await?;
                Ok(Generation {
                    worker: worker(resp.metadata()),
                    stream: Stream::Vllm(resp.into_inner()),
                })
            }
            GrpcClient::Sglang(c) => {
                let req = sglang::GenerateRequest {
                    request_id: call.request_id.clone(),
                    tokenized: Some(sglang::TokenizedInput {
                        original_text: String::new(),
                        input_ids: ids,
                    }),
                    sampling_params: Some(sglang::SamplingParams {
                        max_new_tokens: Some(call.max_tokens),
                    }),
                    data_parallel_rank: call.rank,
                    stream: true,
                };
                let resp = c.generate(debugged(req, call)?).await?;
                Ok(Generation {
                    worker: worker(resp.metadata()),
                    stream: Stream::Sglang(resp.into_inner()),
                })
            }
        }
    }
}

/// `req` asking, with the admin token, which rank serves it (rankgate then names it in
/// `x-rankgate-worker` whatever `server.expose_worker` says).
fn debugged<T>(req: T, call: &GenerateCall) -> Result<tonic::Request<T>, Status> {
    let mut req = tonic::Request::new(req);
    if let Some(t) = &call.admin_token {
        let token = (t.parse())
            .map_err(|_| Status::invalid_argument("the admin token is not a valid header value"))?;
        let m = req.metadata_mut();
        m.insert(
            "x-rankgate-debug",
            tonic::metadata::MetadataValue::from_static("1"),
        );
        m.insert("x-rankgate-admin-token", token);
    }
    Ok(req)
}

/// The HTTP-like status a gRPC status is reported under (the report classes errors by status).
fn status_of(code: Code) -> u16 {
    match code {
        Code::Ok => 200,
        Code::InvalidArgument | Code::NotFound | Code::FailedPrecondition | Code::OutOfRange => 400,
        Code::Unauthenticated => 401,
        Code::PermissionDenied => 403,
        Code::ResourceExhausted => 429,
        Code::Unimplemented => 501,
        Code::DeadlineExceeded => 504,
        _ => 503,
    }
}

/// One timed generation, as the load report records it.
pub async fn one(mut client: GrpcClient, call: GenerateCall, start: Instant) -> Outcome {
    let failed = |status: &Status| {
        let code = status_of(status.code());
        let kind = if code < 500 {
            ErrorKind::Http4xx
        } else {
            ErrorKind::Http5xx
        };
        Outcome {
            status: code,
            ..Outcome::failed(kind, start.elapsed())
        }
    };
    let mut g = match client.generate(&call).await {
        Ok(g) => g,
        // A transport failure before any answer: tonic reports it as UNAVAILABLE/UNKNOWN with
        // a source, which is what the HTTP side counts as a connect error.
        Err(s) if std::error::Error::source(&s).is_some() => {
            return Outcome::failed(ErrorKind::Connect, start.elapsed())
        }
        Err(s) => return failed(&s),
    };
    let mut o = Outcome {
        status: 200,
        error: None,
        worker: g.worker.take(),
        ..Outcome::failed(ErrorKind::Body, Duration::ZERO)
    };
    let mut last: Option<Instant> = None;
    // Ok only once the engine's completion came: a stream that ends without it was cut.
    o.error = Some(ErrorKind::StreamCut);
    loop {
        match g.next().await {
            Ok(Some(Event::Chunk { completion })) => {
                let now = Instant::now();
                match last {
                    None => o.ttft = Some(now - start),
                    Some(prev) => o.itl.push(now - prev),
                }
                last = Some(now);
                o.tokens = u64::from(completion);
            }
            Ok(Some(Event::Complete { tokens, .. })) => {
                o.tokens = tokens as u64;
                o.error = None;
            }
            Ok(None) => break,
            Err(s) => {
                let f = failed(&s);
                (o.status, o.error) = (f.status, Some(ErrorKind::StreamErrorEvent));
                break;
            }
        }
    }
    o.e2e = start.elapsed();
    o
}
