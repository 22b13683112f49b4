//! What the gRPC fault tests share: the [`FaultyEngine`] (a bare h2c server that hangs, stalls or
//! fails every call, its telemetry from a simulated engine with the same ranks), its `[[engines]]`
//! table, a good `Generate` through the router, a long one, and a stream read until it fails.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message;
use rankgate::app::Router;
use rankgate::proto::{sglang, vllm};
use rankgate_sim::sim::SimFlavor as Flavor;
use tokio::task::{JoinHandle, JoinSet};
use tonic::Code;

use crate::common::grpc::*;
use crate::common::*;

/// What a [`FaultyEngine`] does with every call.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// Takes the call and never answers: no response headers, ever.
    Hang,
    /// Answers with this many `Generate` chunks of its flavor, then goes quiet, stream open.
    StallAfter(u32),
    /// Answers at once with this status and no message (trailers-only), as a tonic servicer
    /// does when its handler fails.
    Status(Code),
    /// Answers with this many chunks, then ends the stream with this status in its trailers,
    /// as a servicer whose scheduler dies mid-generation does.
    FailAfter(u32, Code),
}

/// A gRPC engine that misbehaves in a way the simulator's gRPC side cannot: an h2c server that
/// answers every call with its [`Fault`]. It counts the calls it got and those still open (the
/// handler waiting, or the response body alive), so a test sees rankgate cancel the engine's
/// stream.
pub struct FaultyEngine {
    pub addr: SocketAddr,
    pub flavor: Flavor,
    pub calls: Arc<AtomicUsize>,
    open: Arc<AtomicUsize>,
    pub server: JoinHandle<()>,
}

impl Drop for FaultyEngine {
    fn drop(&mut self) {
        // Its connections live in the server task's JoinSet: they go with it.
        self.server.abort();
    }
}

/// Counts a call as open while alive.
struct OpenCall(pub Arc<AtomicUsize>);

impl OpenCall {
    pub fn new(open: &Arc<AtomicUsize>) -> OpenCall {
        open.fetch_add(1, SeqCst);
        OpenCall(open.clone())
    }
}

impl Drop for OpenCall {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

/// A response body that sends its frames, then ends if `end`, else sends nothing, forever
/// (until dropped).
struct FaultBody {
    frames: Vec<Bytes>,
    pub end: bool,
    /// Sent after the frames (only with `end`).
    pub trailers: Option<http::HeaderMap>,
    _open: OpenCall,
}

impl Body for FaultBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        match (this.frames.is_empty(), this.end) {
            (false, _) => Poll::Ready(Some(Ok(Frame::data(this.frames.remove(0))))),
            (true, true) => Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t)))),
            // Silent for good: nothing will ever wake this body.
            (true, false) => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.end && self.frames.is_empty() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// `n` `Generate` chunks of the flavor, framed (completion tokens 1..=n).
pub fn chunks(flavor: Flavor, n: u32) -> Vec<Bytes> {
    (1..=n)
        .map(|completion| {
            let message = match flavor {
                Flavor::Vllm => vllm::GenerateResponse {
                    response: Some(vllm::generate_response::Response::Chunk(
                        vllm::GenerateStreamChunk {
                            token_ids: vec![100 + completion],
                            prompt_tokens: 4,
                            completion_tokens: completion,
                            cached_tokens: 0,
                        },
                    )),
                }
                .encode_to_vec(),
                Flavor::Sglang => sglang::GenerateResponse {
                    request_id: "stalled".into(),
                    response: Some(sglang::generate_response::Response::Chunk(
                        sglang::GenerateStreamChunk {
                            token_ids: vec![100 + completion],
                            prompt_tokens: 4,
                            completion_tokens: completion,
                            cached_tokens: 0,
                        },
                    )),
                }
                .encode_to_vec(),
            };
            frame(&message)
        })
        .collect()
}

impl FaultyEngine {
    pub async fn start(flavor: Flavor, fault: Fault) -> FaultyEngine {
        let listener = tokio::net::TcpListener::bind(loopback()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let open = Arc::new(AtomicUsize::new(0));
        let (c, o) = (calls.clone(), open.clone());
        let server = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (calls, open) = (c.clone(), o.clone());
                let svc = hyper::service::service_fn(move |_req: Request<Incoming>| {
                    calls.fetch_add(1, SeqCst);
                    let open = OpenCall::new(&open);
                    async move {
                        match fault {
                            Fault::Hang => {
                                let _open = open;
                                std::future::pending::<Result<Response<FaultBody>, Infallible>>()
                                    .await
                            }
                            Fault::StallAfter(k) => Ok(Response::builder()
                                .header("content-type", "application/grpc")
                                .body(FaultBody {
                                    frames: chunks(flavor, k),
                                    end: false,
                                    trailers: None,
                                    _open: open,
                                })
                                .unwrap()),
                            Fault::Status(code) => Ok(Response::builder()
                                .header("content-type", "application/grpc")
                                .header("grpc-status", code as i32)
                                .header("grpc-message", "engine overloaded")
                                .body(FaultBody {
                                    frames: Vec::new(),
                                    end: true,
                                    trailers: None,
                                    _open: open,
                                })
                                .unwrap()),
                            Fault::FailAfter(k, code) => {
                                let mut trailers = http::HeaderMap::new();
                                trailers.insert("grpc-status", (code as i32).into());
                                Ok(Response::builder()
                                    .header("content-type", "application/grpc")
                                    .body(FaultBody {
                                        frames: chunks(flavor, k),
                                        end: true,
                                        trailers: Some(trailers),
                                        _open: open,
                                    })
                                    .unwrap())
                            }
                        }
                    }
                });
                conns.spawn(async move {
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        FaultyEngine {
            addr,
            flavor,
            calls,
            open,
            server,
        }
    }

    /// Its worker name in rankgate (it is known by its `grpc_url`).
    pub fn worker(&self, rank: u32) -> String {
        format!("http://{}@{rank}", self.addr)
    }

    /// Its `[[engines]]` table: calls to it, telemetry from `tele` (a simulated engine with
    /// the same ranks).
    pub fn toml(&self, tele: &Eng) -> String {
        faulty_toml(self.addr, self.flavor, tele)
    }

    pub fn calls(&self) -> usize {
        self.calls.load(SeqCst)
    }

    /// Waits (bounded) until no call is open on it any more: rankgate cancelled its streams.
    pub async fn wait_all_closed(&self) {
        until(
            "the engine's streams are cancelled",
            Duration::from_secs(10),
            || self.open.load(SeqCst) == 0,
        )
        .await;
    }
}

/// An `[[engines]]` table with `grpc_url` = `addr` and GetLoads telemetry from `tele`.
pub fn faulty_toml(addr: SocketAddr, flavor: Flavor, tele: &Eng) -> String {
    format!(
        "[[engines]]\ngrpc_url = \"http://{addr}\"\nflavor = \"{}\"\ndp_size = {}\nstart_rank = {}\ntelemetry = [\"grpc://{}\"]\n",
        flavor.as_str(),
        tele.dp_size,
        tele.start_rank,
        tele.grpc
    )
}

/// Reads the stream until it fails; the events before, and the status it failed with. Panics
/// if it ends OK or runs past `limit` events.
pub async fn until_failure(g: &mut Gen, limit: usize) -> (Vec<Ev>, tonic::Status) {
    let mut events = Vec::new();
    loop {
        match g.try_next().await {
            Ok(Some(ev)) => events.push(ev),
            Ok(None) => panic!("the stream ended OK after {} events", events.len()),
            Err(status) => return (events, status),
        }
        assert!(events.len() <= limit, "no failure within {limit} events");
    }
}

/// One short generation through rankgate that must succeed: the worker that served it.
pub async fn good_generate(r: &Router, flavor: Flavor, id: &str) -> String {
    let mut c = front(r, flavor);
    let mut g = c
        .start(id, None, 3)
        .await
        .unwrap_or_else(|s| panic!("{flavor:?} {id}: {s:?}"));
    assert_eq!(g.stream.all(4).await, complete(3), "{flavor:?} {id}");
    g.worker.expect("x-rankgate-worker")
}

/// A raw Generate of 100,000 tokens through rankgate's gRPC front door, once its first message
/// came (HTTP 200, a data frame): the head, and the body still streaming.
pub async fn long_generate(
    r: &Router,
    flavor: Flavor,
    id: &str,
) -> (http::response::Parts, hyper::body::Incoming) {
    let raw = generate_bytes(flavor, id, None, 100_000);
    let req = grpc_request(r.grpc_addr.unwrap(), &method_path(flavor, "Generate"))
        .body(Full::new(frame(&raw)))
        .unwrap();
    let client = rankgate::http::h2_client::<Full<Bytes>>(Duration::from_secs(2));
    let resp = bounded(client.request(req)).await.expect("h2 request");
    assert_eq!(resp.status(), StatusCode::OK);
    let (parts, mut body) = resp.into_parts();
    let first = bounded(body.frame())
        .await
        .expect("a frame")
        .expect("a chunk");
    assert!(first.is_data(), "{first:?}");
    (parts, body)
}
