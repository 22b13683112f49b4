//! The simulated engine's gRPC inference calls (`Generate`, `Embed`, `Abort`) over real sockets,
//! for both flavors: rank pinning as the real servicers do it, what the engine records of each
//! call, and generations that end early by abort or by a client that leaves.

mod common;

use std::future::Future;
use std::time::Duration;

use common::*;
use prost::Message;
use rankgate::proto::{sglang, vllm};
use rankgate::sim::{SimEngine, SimFlavor as Flavor};
use rankgate::telemetry::grpc::{transport, Transport};
use tonic::{Code, Status, Streaming};

const FLAVORS: [Flavor; 2] = [Flavor::Vllm, Flavor::Sglang];

/// Everything here answers within this; a test that waits longer has failed.
async fn bounded<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .expect("timed out")
}

/// An engine of 2 ranks numbered 2 and 3, its gRPC side started, and a client for it.
async fn grpc_engine(flavor: Flavor) -> (SimEngine, Client) {
    let e = engine(sim(flavor, 2, 2)).await;
    let g = e.start_grpc(loopback()).await.expect("start gRPC");
    let origin: http::Uri = format!("http://{g}").parse().unwrap();
    let t = transport(Duration::from_secs(2));
    let c = match flavor {
        Flavor::Vllm => Client::Vllm(vllm::vllm_engine_client::VllmEngineClient::with_origin(
            t, origin,
        )),
        Flavor::Sglang => Client::Sglang(
            sglang::sglang_scheduler_client::SglangSchedulerClient::with_origin(t, origin),
        ),
    };
    (e, c)
}

enum Client {
    Vllm(vllm::vllm_engine_client::VllmEngineClient<Transport>),
    Sglang(sglang::sglang_scheduler_client::SglangSchedulerClient<Transport>),
}

/// A generation event, whichever flavor framed it.
#[derive(Debug, PartialEq)]
enum Ev {
    Chunk { completion: u32 },
    Complete { reason: String, tokens: usize },
}

enum Gen {
    Vllm(Streaming<vllm::GenerateResponse>),
    Sglang(Streaming<sglang::GenerateResponse>),
}

impl Gen {
    async fn next(&mut self) -> Option<Ev> {
        match self {
            Gen::Vllm(s) => {
                let m = bounded(s.message()).await.expect("stream")?;
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
                let m = bounded(s.message()).await.expect("stream")?;
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
        }
    }
}

impl Client {
    /// Starts a streaming generation; returns the stream and the request's encoded bytes.
    async fn generate(
        &mut self,
        id: &str,
        rank: Option<i32>,
        max: u32,
    ) -> Result<(Gen, Vec<u8>), Status> {
        let (text, ids) = (String::from("hi"), vec![1, 2, 3, 4]);
        match self {
            Client::Vllm(c) => {
                let req = vllm::GenerateRequest {
                    request_id: id.into(),
                    input: Some(vllm::generate_request::Input::Tokenized(
                        vllm::TokenizedInput {
                            original_text: text,
                            input_ids: ids,
                        },
                    )),
                    sampling_params: Some(vllm::SamplingParams {
                        max_tokens: Some(max),
                    }),
                    stream: true,
                    data_parallel_rank: rank,
                };
                let raw = req.encode_to_vec();
                let s = bounded(c.generate(req)).await?.into_inner();
                Ok((Gen::Vllm(s), raw))
            }
            Client::Sglang(c) => {
                let req = sglang::GenerateRequest {
                    request_id: id.into(),
                    tokenized: Some(sglang::TokenizedInput {
                        original_text: text,
                        input_ids: ids,
                    }),
                    sampling_params: Some(sglang::SamplingParams {
                        max_new_tokens: Some(max),
                    }),
                    data_parallel_rank: rank,
                    stream: true,
                };
                let raw = req.encode_to_vec();
                let s = bounded(c.generate(req)).await?.into_inner();
                Ok((Gen::Sglang(s), raw))
            }
        }
    }

    /// One embedding (the rank is sent by SGLang only: vLLM's request has no rank); its dimension.
    async fn embed(&mut self, id: &str, rank: i32) -> Result<usize, Status> {
        let ids = vec![5, 6, 7];
        match self {
            Client::Vllm(c) => {
                let req = vllm::EmbedRequest {
                    request_id: id.into(),
                    tokenized: Some(vllm::TokenizedInput {
                        original_text: String::new(),
                        input_ids: ids,
                    }),
                };
                let r = bounded(c.embed(req)).await?.into_inner();
                assert_eq!(r.embedding_dim as usize, r.embedding.len());
                Ok(r.embedding.len())
            }
            Client::Sglang(c) => {
                let req = sglang::EmbedRequest {
                    request_id: id.into(),
                    tokenized: Some(sglang::TokenizedInput {
                        original_text: String::new(),
                        input_ids: ids,
                    }),
                    data_parallel_rank: rank,
                };
                let r = bounded(c.embed(req)).await?.into_inner();
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

    async fn abort(&mut self, id: &str) -> Result<(), Status> {
        match self {
            Client::Vllm(c) => {
                let req = vllm::AbortRequest {
                    request_ids: vec![id.into()],
                };
                bounded(c.abort(req)).await?;
            }
            Client::Sglang(c) => {
                let req = sglang::AbortRequest {
                    request_id: id.into(),
                    reason: String::new(),
                };
                assert!(bounded(c.abort(req)).await?.into_inner().success);
            }
        }
        Ok(())
    }
}

/// Waits (bounded) until no rank runs anything and no request is open.
async fn wait_idle(e: &SimEngine) {
    for _ in 0..200 {
        if e.running().iter().all(|&n| n == 0) && e.open_requests() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!(
        "still busy: running {:?}, open {}",
        e.running(),
        e.open_requests()
    );
}

#[tokio::test]
async fn generate_streams_from_the_pinned_rank() {
    for flavor in FLAVORS {
        let (e, mut c) = grpc_engine(flavor).await;
        let (mut s, raw) = c.generate("g1", Some(3), 5).await.unwrap();
        let mut events = Vec::new();
        while let Some(ev) = s.next().await {
            events.push(ev);
            assert!(events.len() <= 6, "{flavor:?}: too many events {events:?}");
        }
        let mut want: Vec<Ev> = (1..=5).map(|completion| Ev::Chunk { completion }).collect();
        want.push(Ev::Complete {
            reason: "length".into(),
            tokens: 5,
        });
        assert_eq!(events, want, "{flavor:?}");
        assert_eq!(
            e.served(),
            vec![0, 1],
            "{flavor:?}: local rank 1 is global 3"
        );
        let seen = e.grpc_seen();
        assert_eq!(seen.len(), 1, "{flavor:?}");
        assert_eq!(seen[0].method, "Generate");
        assert_eq!(seen[0].rank, Some(3));
        assert_eq!(seen[0].raw, raw, "{flavor:?}: the message as sent");

        // No rank: the engine picks its least loaded rank (both idle: the first).
        let (mut s, _) = c.generate("g2", None, 2).await.unwrap();
        while s.next().await.is_some() {}
        assert_eq!(e.grpc_seen()[1].rank, Some(2), "{flavor:?}");
    }
}

#[tokio::test]
async fn out_of_range_rank_is_invalid_argument() {
    for flavor in FLAVORS {
        let (e, mut c) = grpc_engine(flavor).await;
        for rank in [0, 1, 4, -1] {
            let err = match c.generate("bad", Some(rank), 3).await {
                Ok(_) => panic!("{flavor:?}: rank {rank} accepted"),
                Err(err) => err,
            };
            assert_eq!(err.code(), Code::InvalidArgument, "{flavor:?} {rank}");
            assert!(
                err.message().contains(&rank.to_string()) && err.message().contains("[2, 4)"),
                "{flavor:?}: {}",
                err.message()
            );
        }
        if flavor == Flavor::Sglang {
            let err = c.embed("bad", 9).await.unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument);
            assert!(err.message().contains("9"), "{}", err.message());
        }
        assert!(
            e.grpc_seen().is_empty(),
            "{flavor:?}: a refused rank leaves no record"
        );
        assert_eq!(e.served(), vec![0, 0]);
    }
}

#[tokio::test]
async fn embed_answers() {
    for flavor in FLAVORS {
        let (e, mut c) = grpc_engine(flavor).await;
        assert_eq!(c.embed("e1", 3).await.unwrap(), 8, "{flavor:?}");
        let seen = e.grpc_seen();
        assert_eq!(seen[0].method, "Embed");
        // SGLang pins by the request's rank; vLLM's request has none, so the engine balances.
        let want = if flavor == Flavor::Sglang { 3 } else { 2 };
        assert_eq!(seen[0].rank, Some(want), "{flavor:?}");
        assert_eq!(e.served().iter().sum::<u64>(), 1);
    }
}

#[tokio::test]
async fn abort_ends_a_running_stream() {
    for flavor in FLAVORS {
        let (e, mut c) = grpc_engine(flavor).await;
        // 100k tokens at 200/s: only an abort ends this within the test.
        let (mut s, _) = c.generate("long", Some(2), 100_000).await.unwrap();
        assert_eq!(s.next().await, Some(Ev::Chunk { completion: 1 }));
        c.abort("long").await.unwrap();
        let mut end = None;
        for _ in 0..10_000 {
            match s.next().await {
                Some(Ev::Chunk { .. }) => {}
                Some(Ev::Complete { reason, tokens }) => {
                    end = Some((reason, tokens));
                    break;
                }
                None => break,
            }
        }
        let (reason, tokens) = end.expect("a final message");
        assert_eq!(reason, "abort", "{flavor:?}");
        assert!(tokens < 100_000);
        assert_eq!(s.next().await, None, "{flavor:?}: the stream ends");
        assert_eq!(e.aborted(), vec!["long".to_string()]);
        let seen = e.grpc_seen();
        assert_eq!(
            seen.last().map(|s| (s.method, s.rank)),
            Some(("Abort", None))
        );
        wait_idle(&e).await;
    }
}

#[tokio::test]
async fn dropping_the_client_stream_stops_generation() {
    for flavor in FLAVORS {
        let (e, mut c) = grpc_engine(flavor).await;
        let (mut s, _) = c.generate("gone", Some(3), 100_000).await.unwrap();
        assert_eq!(s.next().await, Some(Ev::Chunk { completion: 1 }));
        assert_eq!(e.running(), vec![0, 1], "{flavor:?}");
        drop(s);
        wait_idle(&e).await;
        assert!(
            e.kv_usage().iter().all(|&u| u == 0.0),
            "{flavor:?}: KV freed"
        );
    }
}
