//! Bad input on the gRPC front door: what is not protobuf, compressed, two messages, a cut frame,
//! no frame, too large, not gRPC at all, no method or an unknown service gets a clear status and
//! never reaches an engine; a request that is not gRPC gets HTTP 415, a gRPC call over HTTP/1.1 is
//! refused before any engine, and an Abort that is not protobuf is INVALID_ARGUMENT.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use rankgate_sim::sim::SimFlavor as Flavor;
use tonic::Code;

use crate::common::grpc::*;
use crate::common::*;
use crate::helpers::*;

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
