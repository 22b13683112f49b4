//! rankgate's gRPC front door on the fleet's bad days, over real sockets on 127.0.0.1, for both
//! flavors where it is cheap. It proves that:
//!
//! - an engine killed mid-stream ends the client's stream with a gRPC status, UNAVAILABLE naming
//!   the worker (never a bare transport error), nothing stays in flight, and the next call goes
//!   to the other engine; a port that refuses connections is retried on the other engine;
//! - an engine that takes a call and never answers gets DEADLINE_EXCEEDED after
//!   `server.response_timeout`, and one that goes quiet mid-stream DEADLINE_EXCEEDED in the
//!   trailers after `server.stream_idle_timeout`, after the chunks it did send; either way the
//!   engine's stream is cancelled;
//! - bad input (not protobuf, compressed, two messages, a cut frame, no frame, too large, not
//!   gRPC at all, no method, an unknown service) gets a clear status, never reaches an engine,
//!   and the next good call is served;
//! - `server.max_in_flight` and client API keys hold on the gRPC front door;
//! - a shutdown lets a stream in flight finish and refuses new connections;
//! - an engine that answers every call UNAVAILABLE is ejected like one answering 503 over HTTP;
//!   a request that is not gRPC gets HTTP 415 (as the gRPC spec asks), a gRPC call over
//!   HTTP/1.1 (whose status could never reach the client) is refused before any engine, and an
//!   Abort that is not protobuf is INVALID_ARGUMENT. These four fail today: see each test.
//!
//! The simulated engine's gRPC side has no knob for a hung or a stalling call (`hang_requests`,
//! `stall_after_tokens` and `set_fail` act on its HTTP side only), so those engines are
//! [`FaultyEngine`]s here: a bare h2c server whose telemetry comes from a simulated engine with
//! the same ranks (`telemetry = ["grpc://..."]`). Every wait is bounded.

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::grpc::*;
use common::*;
use http::{Request, Response, StatusCode, Version};
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

/// What a [`FaultyEngine`] does with every call.
#[derive(Debug, Clone, Copy)]
enum Fault {
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
struct FaultyEngine {
    addr: SocketAddr,
    flavor: Flavor,
    calls: Arc<AtomicUsize>,
    open: Arc<AtomicUsize>,
    server: JoinHandle<()>,
}

impl Drop for FaultyEngine {
    fn drop(&mut self) {
        // Its connections live in the server task's JoinSet: they go with it.
        self.server.abort();
    }
}

/// Counts a call as open while alive.
struct OpenCall(Arc<AtomicUsize>);

impl OpenCall {
    fn new(open: &Arc<AtomicUsize>) -> OpenCall {
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
    end: bool,
    /// Sent after the frames (only with `end`).
    trailers: Option<http::HeaderMap>,
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
fn chunks(flavor: Flavor, n: u32) -> Vec<Bytes> {
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
    async fn start(flavor: Flavor, fault: Fault) -> FaultyEngine {
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
    fn worker(&self, rank: u32) -> String {
        format!("http://{}@{rank}", self.addr)
    }

    /// Its `[[engines]]` table: calls to it, telemetry from `tele` (a simulated engine with
    /// the same ranks).
    fn toml(&self, tele: &Eng) -> String {
        faulty_toml(self.addr, self.flavor, tele)
    }

    fn calls(&self) -> usize {
        self.calls.load(SeqCst)
    }

    /// Waits (bounded) until no call is open on it any more: rankgate cancelled its streams.
    async fn wait_all_closed(&self) {
        until(
            "the engine's streams are cancelled",
            Duration::from_secs(10),
            || self.open.load(SeqCst) == 0,
        )
        .await;
    }
}

/// An `[[engines]]` table with `grpc_url` = `addr` and GetLoads telemetry from `tele`.
fn faulty_toml(addr: SocketAddr, flavor: Flavor, tele: &Eng) -> String {
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
async fn until_failure(g: &mut Gen, limit: usize) -> (Vec<Ev>, tonic::Status) {
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
async fn good_generate(r: &Router, flavor: Flavor, id: &str) -> String {
    let mut c = front(r, flavor);
    let mut g = c
        .start(id, None, 3)
        .await
        .unwrap_or_else(|s| panic!("{flavor:?} {id}: {s:?}"));
    assert_eq!(g.stream.all(4).await, complete(3), "{flavor:?} {id}");
    g.worker.expect("x-rankgate-worker")
}

#[tokio::test]
async fn an_engine_killed_mid_stream_ends_it_unavailable_naming_the_worker() {
    for flavor in FLAVORS {
        let (a, b, r) = two_engines(flavor).await;
        // a is the idler: the stream goes there.
        a.sim.set_kv_usage(vec![0.1]);
        b.sim.set_kv_usage(vec![0.9]);
        wait_kv(&r, &[(0, 0.1), (1, 0.9)]).await;
        let mut c = front(&r, flavor);
        let mut g = c.start("doomed", None, 100_000).await.unwrap();
        assert_eq!(g.worker, Some(a.worker(0)), "{flavor:?}");
        assert_eq!(g.stream.next().await, Some(Ev::Chunk { completion: 1 }));

        a.sim.kill().await;
        let (_, status) = until_failure(&mut g.stream, 10_000).await;
        assert_eq!(status.code(), Code::Unavailable, "{flavor:?}: {status:?}");
        assert!(
            status.message().contains(&a.worker(0)),
            "{flavor:?}: the status names the worker: {status:?}"
        );
        wait_no_in_flight(&r).await;

        // At once, before telemetry says a is gone: b serves the next call.
        assert_eq!(
            good_generate(&r, flavor, "after").await,
            b.worker(1),
            "{flavor:?}"
        );
        assert!(b.generated(), "{flavor:?}");
        wait_no_in_flight(&r).await;
    }
}

/// A raw Generate of 100,000 tokens through rankgate's gRPC front door, once its first message
/// came (HTTP 200, a data frame): the head, and the body still streaming.
async fn long_generate(
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

#[tokio::test]
async fn a_killed_stream_ends_with_the_status_in_its_trailers() {
    // The wire under the status above: HTTP 200 and the messages sent before, then trailers.
    let flavor = Flavor::Sglang;
    let e = Eng::start(flavor, 1, 0).await;
    let r = grpc_router(&[&e]).await;
    wait_state(&r, &[0], "available").await;
    let (parts, body) = long_generate(&r, flavor, "dies").await;

    e.sim.kill().await;
    let rest = bounded(body.collect())
        .await
        .expect("the rest, then trailers");
    let trailers = rest.trailers().expect("trailers").clone();
    assert!(
        !parts.headers.contains_key("grpc-status"),
        "not trailers-only"
    );
    assert_eq!(trailers["grpc-status"], "14", "UNAVAILABLE: {trailers:?}");
    let message = trailers["grpc-message"].to_str().unwrap().to_string();
    assert!(message.contains(&e.worker(0)), "{message}");
    assert!(message.contains("broke"), "{message}");
    wait_no_in_flight(&r).await;
}

#[tokio::test]
async fn a_hung_engine_is_deadline_exceeded_after_the_response_timeout() {
    for flavor in FLAVORS {
        let tele = Eng::start(flavor, 1, 0).await;
        let hung = FaultyEngine::start(flavor, Fault::Hang).await;
        let r = grpc_router_with("response_timeout = \"300ms\"", &[hung.toml(&tele)]).await;
        wait_state(&r, &[0], "available").await;

        let started = Instant::now();
        let err = match front(&r, flavor).start("hung", None, 3).await {
            Ok(s) => panic!("{flavor:?}: answered by {:?}", s.worker),
            Err(err) => err,
        };
        let took = started.elapsed();
        assert_eq!(err.code(), Code::DeadlineExceeded, "{flavor:?}: {err:?}");
        assert!(
            err.message().contains(&hung.worker(0)),
            "{flavor:?}: names the worker: {err:?}"
        );
        assert!(
            err.message().contains("response_timeout"),
            "{flavor:?}: {err:?}"
        );
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(5),
            "{flavor:?}: after {took:?}"
        );
        assert_eq!(
            hung.calls(),
            1,
            "{flavor:?}: a response timeout is not retried"
        );
        wait_no_in_flight(&r).await;
        hung.wait_all_closed().await;
    }
}

#[tokio::test]
async fn a_stream_that_stalls_ends_deadline_exceeded_after_its_chunks() {
    for flavor in FLAVORS {
        let tele = Eng::start(flavor, 1, 0).await;
        let stalled = FaultyEngine::start(flavor, Fault::StallAfter(3)).await;
        let r = grpc_router_with("stream_idle_timeout = \"300ms\"", &[stalled.toml(&tele)]).await;
        wait_state(&r, &[0], "available").await;

        let mut g = front(&r, flavor).start("quiet", None, 10).await.unwrap();
        assert_eq!(g.worker, Some(stalled.worker(0)), "{flavor:?}");
        let (events, status) = until_failure(&mut g.stream, 3).await;
        let three: Vec<Ev> = (1..=3).map(|completion| Ev::Chunk { completion }).collect();
        assert_eq!(
            events, three,
            "{flavor:?}: the chunks sent before the stall"
        );
        assert_eq!(
            status.code(),
            Code::DeadlineExceeded,
            "{flavor:?}: {status:?}"
        );
        assert!(
            status.message().contains(&stalled.worker(0))
                && status.message().contains("stream_idle_timeout"),
            "{flavor:?}: {status:?}"
        );
        wait_no_in_flight(&r).await;
        stalled.wait_all_closed().await;

        // On the wire: HTTP 200, the three messages, then the status in the trailers.
        let raw = generate_bytes(flavor, "quiet-raw", None, 10);
        let reply = raw_call(r.grpc_addr.unwrap(), &method_path(flavor, "Generate"), &raw).await;
        assert_eq!(reply.http, StatusCode::OK, "{flavor:?}");
        assert_eq!(reply.messages.len(), 3, "{flavor:?}: {reply:?}");
        assert_eq!(reply.code, Code::DeadlineExceeded, "{flavor:?}: {reply:?}");
        assert!(
            !reply.headers.contains_key("grpc-status"),
            "{flavor:?}: the status comes in the trailers, after the messages"
        );
        wait_no_in_flight(&r).await;
        stalled.wait_all_closed().await;
    }
}

#[tokio::test]
async fn a_client_that_gives_up_on_a_hung_engine_cancels_the_engines_call() {
    for flavor in FLAVORS {
        let tele = Eng::start(flavor, 1, 0).await;
        let hung = FaultyEngine::start(flavor, Fault::Hang).await;
        // The default response timeout (30 min): only the client leaving ends this call.
        let r = router(GRPC_FAST, &[hung.toml(&tele)]).await;
        wait_state(&r, &[0], "available").await;
        let (grpc, path) = (r.grpc_addr.unwrap(), method_path(flavor, "Generate"));
        let raw = generate_bytes(flavor, "impatient", None, 3);
        let call = tokio::spawn(async move { raw_call(grpc, &path, &raw).await });
        until("the engine has the call", Duration::from_secs(10), || {
            hung.calls() == 1
        })
        .await;
        wait_workers(&r, Duration::from_secs(10), |rows| {
            rows[0]["in_flight"] == 1
        })
        .await;

        call.abort();
        hung.wait_all_closed().await;
        wait_no_in_flight(&r).await;
    }
}

#[tokio::test]
async fn an_engine_that_answers_every_call_unavailable_is_ejected() {
    for flavor in FLAVORS {
        // Engine 0 looks idlest (its telemetry, from a simulated engine, says KV 0.1) and
        // answers every call UNAVAILABLE at once, as a servicer whose scheduler died does: over
        // HTTP that is a 503, which counts against the rank until it is ejected.
        let tele = Eng::start(flavor, 1, 0).await;
        let failing = FaultyEngine::start(flavor, Fault::Status(Code::Unavailable)).await;
        let b = Eng::start(flavor, 1, 1).await;
        tele.sim.set_kv_usage(vec![0.1]);
        b.sim.set_kv_usage(vec![0.9]);
        let cfg = format!("{GRPC_FAST}[routing]\neject_after = 2\n");
        let r = router(&cfg, &[failing.toml(&tele), b.toml()]).await;
        wait_state(&r, &[0, 1], "available").await;
        wait_kv(&r, &[(0, 0.1), (1, 0.9)]).await;

        let (grpc, path) = (r.grpc_addr.unwrap(), method_path(flavor, "Generate"));
        let mut replies = Vec::new();
        for i in 0..6 {
            let raw = generate_bytes(flavor, &format!("u{i}"), None, 3);
            let reply = raw_call(grpc, &path, &raw).await;
            replies.push((reply.code, reply.worker().map(str::to_string)));
        }
        let rows = workers(&r).await;
        assert!(
            failing.calls() <= 2,
            "{flavor:?}: with routing.eject_after = 2 the failing engine got {} of 6 calls \
             (consecutive_failures {}): replies {replies:?}",
            failing.calls(),
            rows[0]["consecutive_failures"]
        );
        for (code, worker) in &replies[2..] {
            assert_eq!(*code, Code::Ok, "{flavor:?}: {replies:?}");
            assert_eq!(worker.as_deref(), Some(b.worker(1).as_str()), "{flavor:?}");
        }
    }
}

#[tokio::test]
async fn an_engine_whose_streams_end_unavailable_is_ejected() {
    for flavor in FLAVORS {
        // As above, but each call gets two chunks before its UNAVAILABLE: too late to retry,
        // still a failure of the rank.
        let tele = Eng::start(flavor, 1, 0).await;
        let failing = FaultyEngine::start(flavor, Fault::FailAfter(2, Code::Unavailable)).await;
        let b = Eng::start(flavor, 1, 1).await;
        tele.sim.set_kv_usage(vec![0.1]);
        b.sim.set_kv_usage(vec![0.9]);
        let cfg = format!("{GRPC_FAST}[routing]\neject_after = 2\n");
        let r = router(&cfg, &[failing.toml(&tele), b.toml()]).await;
        wait_state(&r, &[0, 1], "available").await;
        wait_kv(&r, &[(0, 0.1), (1, 0.9)]).await;

        let (grpc, path) = (r.grpc_addr.unwrap(), method_path(flavor, "Generate"));
        let mut replies = Vec::new();
        for i in 0..6 {
            let raw = generate_bytes(flavor, &format!("m{i}"), None, 3);
            let reply = raw_call(grpc, &path, &raw).await;
            replies.push((
                reply.code,
                reply.messages.len(),
                reply.worker().map(str::to_string),
            ));
        }
        assert_eq!(
            failing.calls(),
            2,
            "{flavor:?}: ejected after two: {replies:?}"
        );
        assert_eq!(
            replies[0].0,
            Code::Unavailable,
            "{flavor:?}: the engine's own status"
        );
        assert_eq!(replies[0].1, 2, "{flavor:?}: after its two chunks");
        for (code, _, worker) in &replies[2..] {
            assert_eq!(*code, Code::Ok, "{flavor:?}: {replies:?}");
            assert_eq!(worker.as_deref(), Some(b.worker(1).as_str()), "{flavor:?}");
        }
    }
}

#[tokio::test]
async fn a_port_that_refuses_connections_is_retried_on_the_other_engine() {
    for flavor in FLAVORS {
        // Engine 0 reports (through a simulated engine's GetLoads) the lowest KV, but its
        // grpc_url refuses connections: the first attempt goes there and fails to connect.
        let tele = Eng::start(flavor, 1, 0).await;
        let b = Eng::start(flavor, 1, 1).await;
        let dead = refusing_port().await;
        tele.sim.set_kv_usage(vec![0.1]);
        b.sim.set_kv_usage(vec![0.9]);
        let r = router(GRPC_FAST, &[faulty_toml(dead, flavor, &tele), b.toml()]).await;
        wait_state(&r, &[0, 1], "available").await;
        wait_kv(&r, &[(0, 0.1), (1, 0.9)]).await;

        assert_eq!(
            good_generate(&r, flavor, "retried").await,
            b.worker(1),
            "{flavor:?}"
        );
        assert_eq!(
            r.metrics.retries_total(),
            1,
            "{flavor:?}: the first attempt went to the refusing port"
        );
        assert!(b.generated(), "{flavor:?}");
        wait_no_in_flight(&r).await;
    }
}

/// A body whose size is unknown up front (no content-length): its pieces one by one.
struct Pieces(Vec<Bytes>);

impl Body for Pieces {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        Poll::Ready((!this.0.is_empty()).then(|| Ok(Frame::data(this.0.remove(0)))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[tokio::test]
async fn bad_input_gets_a_clear_status_and_never_reaches_an_engine() {
    for flavor in FLAVORS {
        let e = Eng::start(flavor, 1, 0).await;
        let r = grpc_router_with("max_body_bytes = 4096", &[e.toml()]).await;
        wait_state(&r, &[0], "available").await;
        let grpc = r.grpc_addr.unwrap();
        let path = method_path(flavor, "Generate");
        let good = frame(&generate_bytes(flavor, "g", None, 3));
        let body = |b: Vec<u8>| grpc_request(grpc, &path).body(Full::new(Bytes::from(b)));

        let mut compressed = good.to_vec();
        compressed[0] = 1;
        let mut cut_short = good.to_vec();
        cut_short[4] += 10;
        // A valid message, 8 KiB of it in an unknown field 99, over max_body_bytes = 4096.
        let mut large = generate_bytes(flavor, "big", None, 3);
        large.extend_from_slice(&[0x9a, 0x06, 0x80, 0x40]);
        large.extend_from_slice(&[b'x'; 8192]);
        let large = frame(&large);
        let pieces: Vec<Bytes> = large.chunks(1000).map(Bytes::copy_from_slice).collect();

        let cases: Vec<(&str, RawReply, Code, &str)> = vec![
            (
                "not protobuf",
                raw_call(grpc, &path, &[0xff; 32]).await,
                Code::InvalidArgument,
                "request message",
            ),
            (
                "compressed",
                raw_request(
                    grpc_request(grpc, &path)
                        .header("grpc-encoding", "gzip")
                        .body(Full::new(Bytes::from(compressed)))
                        .unwrap(),
                )
                .await,
                Code::Unimplemented,
                "compressed",
            ),
            (
                "two messages",
                raw_request(body([&good[..], &good[..]].concat()).unwrap()).await,
                Code::InvalidArgument,
                "more than one",
            ),
            (
                "cut short",
                raw_request(body(cut_short).unwrap()).await,
                Code::InvalidArgument,
                "cut short",
            ),
            (
                "empty body",
                raw_request(body(Vec::new()).unwrap()).await,
                Code::InvalidArgument,
                "no message",
            ),
            (
                "too large, with content-length",
                raw_request(body(large.to_vec()).unwrap()).await,
                Code::ResourceExhausted,
                "max_body_bytes",
            ),
            (
                "too large, streamed",
                raw_request(grpc_request(grpc, &path).body(Pieces(pieces)).unwrap()).await,
                Code::ResourceExhausted,
                "max_body_bytes",
            ),
            (
                "JSON to the gRPC port",
                raw_request(
                    Request::post(format!("http://{grpc}{path}"))
                        .version(Version::HTTP_2)
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from_static(b"{}")))
                        .unwrap(),
                )
                .await,
                Code::InvalidArgument,
                "application/grpc",
            ),
            (
                "HTTP/1.1 to the gRPC port",
                http1(grpc, "POST", "/v1/chat/completions", "application/json").await,
                Code::InvalidArgument,
                "application/grpc",
            ),
            (
                "no method",
                raw_call(grpc, &format!("/{}", service(flavor)), &good[5..]).await,
                Code::Unimplemented,
                service(flavor),
            ),
            (
                "empty method",
                raw_call(grpc, &format!("/{}/", service(flavor)), &good[5..]).await,
                Code::Unimplemented,
                service(flavor),
            ),
            (
                "unknown service",
                raw_call(grpc, "/no.such.Service/Generate", &good[5..]).await,
                Code::Unimplemented,
                "no.such.Service",
            ),
        ];
        for (what, reply, code, says) in cases {
            assert_eq!(reply.code, code, "{flavor:?} {what}: {reply:?}");
            assert!(
                reply.message.contains(says),
                "{flavor:?} {what}: the message says {says:?}: {:?}",
                reply.message
            );
            assert!(reply.messages.is_empty(), "{flavor:?} {what}");
        }
        assert!(
            e.sim.grpc_seen().is_empty(),
            "{flavor:?}: nothing reached the engine: {:?}",
            e.sim.grpc_seen()
        );
        wait_no_in_flight(&r).await;
        assert_eq!(good_generate(&r, flavor, "fine").await, e.worker(0));
    }
}

/// One HTTP/1.1 request with an empty body, read whole.
async fn http1(addr: SocketAddr, method: &str, path: &str, content_type: &str) -> RawReply {
    let req = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", content_type)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = bounded(client().request(req))
        .await
        .expect("HTTP/1.1 request");
    assert_eq!(resp.version(), Version::HTTP_11);
    read_reply(resp).await
}

#[tokio::test]
async fn max_in_flight_refuses_a_second_call_until_the_first_ends() {
    for flavor in FLAVORS {
        let e = Eng::start(flavor, 1, 0).await;
        let r = grpc_router_with("max_in_flight = 1", &[e.toml()]).await;
        wait_state(&r, &[0], "available").await;
        let mut c = front(&r, flavor);
        let mut first = c.start("first", None, 100_000).await.unwrap();
        assert_eq!(first.stream.next().await, Some(Ev::Chunk { completion: 1 }));

        let err = match front(&r, flavor).start("second", None, 3).await {
            Ok(s) => panic!("{flavor:?}: second started on {:?}", s.worker),
            Err(err) => err,
        };
        assert_eq!(err.code(), Code::ResourceExhausted, "{flavor:?}: {err:?}");
        assert!(err.message().contains("max_in_flight"), "{err:?}");

        // Abort is rankgate's own call: it is served at the cap and ends the first stream.
        c.abort("first").await.expect("Abort at the cap");
        let (reason, _) = first
            .stream
            .until_complete()
            .await
            .expect("a final message");
        assert_eq!(reason, "abort", "{flavor:?}");
        assert_eq!(first.stream.next().await, None, "{flavor:?}: ends OK");
        wait_no_in_flight(&r).await;

        assert_eq!(good_generate(&r, flavor, "third").await, e.worker(0));
        let generates = e
            .sim
            .grpc_seen()
            .iter()
            .filter(|s| s.method == "Generate")
            .count();
        assert_eq!(
            generates, 2,
            "{flavor:?}: the refused call never reached the engine"
        );
    }
}

#[tokio::test]
async fn client_api_keys_guard_the_grpc_front_door() {
    let var = format!("RANKGATE_GRPC_FAULTS_KEYS_{}", std::process::id());
    std::env::set_var(&var, "key-one, key-two");
    for flavor in FLAVORS {
        let e = Eng::start(flavor, 1, 0).await;
        let r = grpc_router_with(&format!("api_keys_env = \"{var}\""), &[e.toml()]).await;
        wait_state(&r, &[0], "available").await;
        let grpc = r.grpc_addr.unwrap();
        let path = method_path(flavor, "Generate");
        let raw = generate_bytes(flavor, "keyed", None, 3);

        for (what, metadata) in [
            ("no key", vec![]),
            ("wrong key", vec![("authorization", "Bearer key-three")]),
            ("not bearer", vec![("authorization", "Basic a2V5LW9uZQ==")]),
        ] {
            let reply = raw_call_with(grpc, &path, &raw, &metadata).await;
            assert_eq!(
                reply.code,
                Code::Unauthenticated,
                "{flavor:?} {what}: {reply:?}"
            );
            assert!(!reply.message.is_empty(), "{flavor:?} {what}");
        }
        // The tonic client sends no key: refused the same way.
        let err = match front(&r, flavor).start("tonic", None, 3).await {
            Ok(_) => panic!("{flavor:?}: served without a key"),
            Err(err) => err,
        };
        assert_eq!(err.code(), Code::Unauthenticated, "{flavor:?}: {err:?}");
        assert!(
            e.sim.grpc_seen().is_empty(),
            "{flavor:?}: no call without a key"
        );

        let reply = raw_call_with(grpc, &path, &raw, &[("authorization", "Bearer key-two")]).await;
        assert_eq!(reply.code, Code::Ok, "{flavor:?}: {reply:?}");
        assert_eq!(
            reply.messages.len(),
            4,
            "{flavor:?}: 3 chunks and the final message"
        );
        assert_eq!(reply.worker(), Some(e.worker(0).as_str()));
        wait_no_in_flight(&r).await;
    }
}

#[tokio::test]
async fn shutdown_lets_a_stream_in_flight_finish_and_refuses_new_connections() {
    for flavor in FLAVORS {
        let e = Eng::start(flavor, 1, 0).await;
        let r = grpc_router_with("drain_grace = \"10s\"", &[e.toml()]).await;
        wait_state(&r, &[0], "available").await;
        let grpc = r.grpc_addr.unwrap();
        let mut c = front(&r, flavor);
        // 300 tokens at 200/s: the stream outlasts the checks below.
        let mut g = c.start("draining", None, 300).await.unwrap();
        assert_eq!(g.stream.next().await, Some(Ev::Chunk { completion: 1 }));

        let shutdown = tokio::spawn(r.shutdown());
        until_refused(grpc).await;
        let late = Client::connect(flavor, grpc).start("late", None, 3).await;
        match late {
            Ok(s) => panic!("{flavor:?}: a new connection was served by {:?}", s.worker),
            Err(err) => assert!(
                format!("{err:?}").contains("ConnectionRefused"),
                "{flavor:?}: {err:?}"
            ),
        }
        assert!(!shutdown.is_finished(), "{flavor:?}: draining the stream");

        let rest = g.stream.all(300).await;
        assert_eq!(
            rest.len(),
            300,
            "{flavor:?}: chunks 2..=300 and the final message"
        );
        assert_eq!(
            rest.last(),
            Some(&Ev::Complete {
                reason: "length".into(),
                tokens: 300
            }),
            "{flavor:?}"
        );
        bounded(shutdown).await.expect("shutdown");
        wait_idle(&e.sim).await;
    }
}

/// A stream that outlives the drain grace ends with a status, as every gRPC call must: HTTP 200,
/// the messages sent before, then trailers saying UNAVAILABLE because rankgate is shutting down.
#[tokio::test]
async fn a_stream_outliving_the_drain_grace_ends_unavailable_in_its_trailers() {
    let flavor = Flavor::Vllm;
    let e = Eng::start(flavor, 1, 0).await;
    let r = grpc_router_with("drain_grace = \"300ms\"", &[e.toml()]).await;
    wait_state(&r, &[0], "available").await;
    let (_, body) = long_generate(&r, flavor, "outlives").await;

    let shutdown = tokio::spawn(r.shutdown());
    let rest = bounded(body.collect())
        .await
        .expect("the rest, then trailers");
    let trailers = rest.trailers().expect("trailers").clone();
    assert_eq!(trailers["grpc-status"], "14", "UNAVAILABLE: {trailers:?}");
    let message = trailers["grpc-message"].to_str().unwrap();
    assert!(message.contains("shutting down"), "{message}");
    bounded(shutdown).await.expect("shutdown");
    wait_idle(&e.sim).await;
}

/// Waits (bounded) until connecting to `addr` is refused.
async fn until_refused(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::net::TcpStream::connect(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return,
            other => {
                assert!(
                    Instant::now() < deadline,
                    "still accepting after 10 s: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

#[tokio::test]
async fn a_request_that_is_not_grpc_is_not_answered_200_ok() {
    // gRPC over HTTP/2 (PROTOCOL-HTTP2.md): "If Content-Type does not begin with
    // "application/grpc", gRPC servers SHOULD respond with HTTP status of 415 (Unsupported Media
    // Type). This will prevent other HTTP/2 clients from interpreting a gRPC error response,
    // which uses status 200 (OK), as successful." An OpenAI client pointed at the gRPC port by
    // mistake must not read an empty 200 as an answer.
    let e = Eng::start(Flavor::Vllm, 1, 0).await;
    let r = grpc_router(&[&e]).await;
    wait_state(&r, &[0], "available").await;
    let grpc = r.grpc_addr.unwrap();
    let json_h2 = raw_request(
        Request::post(format!("http://{grpc}/v1/chat/completions"))
            .version(Version::HTTP_2)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap(),
    )
    .await;
    let json_h1 = http1(grpc, "POST", "/v1/chat/completions", "application/json").await;
    for (what, reply) in [("JSON over h2", json_h2), ("JSON over HTTP/1.1", json_h1)] {
        assert_eq!(
            reply.http,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "{what}: answered {} with grpc-status {:?} {:?}",
            reply.http,
            reply.code,
            reply.message
        );
    }
    assert!(e.sim.grpc_seen().is_empty());
}

#[tokio::test]
async fn a_grpc_call_over_http1_is_refused_before_any_engine() {
    // gRPC needs HTTP/2: its status travels in trailers, which rankgate's HTTP/1.1 answers do
    // not carry. A call that came over HTTP/1.1 must be refused (with its status in the
    // headers), not run on an engine whose verdict the client can never read.
    let flavor = Flavor::Vllm;
    let e = Eng::start(flavor, 1, 0).await;
    let r = grpc_router(&[&e]).await;
    wait_state(&r, &[0], "available").await;
    let grpc = r.grpc_addr.unwrap();
    let req = Request::post(format!("http://{grpc}{}", method_path(flavor, "Generate")))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(frame(&generate_bytes(flavor, "h1", None, 3))))
        .unwrap();
    let resp = bounded(client().request(req))
        .await
        .expect("HTTP/1.1 request");
    assert_eq!(resp.version(), Version::HTTP_11);
    let reply = read_reply(resp).await;
    let seen = e.sim.grpc_seen();
    assert!(
        seen.is_empty(),
        "the HTTP/1.1 call ran on the engine ({} call(s)); the client got HTTP {}, {} messages \
         and grpc-status {:?} (none: no trailers over HTTP/1.1)",
        seen.len(),
        reply.http,
        reply.messages.len(),
        reply.headers.get("grpc-status")
    );
    assert!(reply.headers.contains_key("grpc-status"), "{reply:?}");
    assert_ne!(reply.code, Code::Ok, "{reply:?}");
}

#[tokio::test]
async fn an_abort_that_is_not_protobuf_is_invalid_argument() {
    // GetLoads and Health/Check refuse a message that does not decode (INVALID_ARGUMENT), and so
    // does the engine's own servicer; Abort must not answer such a message OK, aborting nothing.
    for flavor in FLAVORS {
        let e = Eng::start(flavor, 1, 0).await;
        let r = grpc_router(&[&e]).await;
        wait_state(&r, &[0], "available").await;
        let grpc = r.grpc_addr.unwrap();
        let loads = raw_call(grpc, &method_path(flavor, "GetLoads"), &[0xff; 32]).await;
        assert_eq!(loads.code, Code::InvalidArgument, "{flavor:?}: {loads:?}");
        let abort = raw_call(grpc, &method_path(flavor, "Abort"), &[0xff; 32]).await;
        assert_eq!(
            abort.code,
            Code::InvalidArgument,
            "{flavor:?}: Abort of a message that is not protobuf: {abort:?}"
        );
    }
}
