//! The router's own tokenization (`rankgate::tokenize`) against what a real vLLM 0.32 engine
//! returned for the same chats (tests/fixtures/vllm-0.32-kv-events/, README there), the cap's
//! exactness, errors, and the `/tokenize` fallback against a local HTTP server.

use std::convert::Infallible;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rankgate::tokenize::{
    engine_tokenize, ChatTokenizer, Limits, TokenizeError, TokenizeRequest, TokenizerFiles,
};
use serde_json::{json, Value};

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm-0.32-kv-events")
}

fn tokenizer() -> ChatTokenizer {
    ChatTokenizer::from_dir(&fixture_dir()).expect("load the fixture's tokenizer")
}

fn golden() -> Vec<Value> {
    let text = std::fs::read_to_string(fixture_dir().join("chat_tokenize_golden.json"))
        .expect("golden file");
    serde_json::from_str(&text).expect("golden JSON")
}

fn ids(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("a list")
        .iter()
        .map(|v| v.as_u64().expect("an id") as u32)
        .collect()
}

fn chat_body(messages: &Value) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "tiny-llama", "messages": messages})).expect("body")
}

#[test]
fn every_golden_chat_turn_is_reproduced_exactly() {
    // With the piece cache (the default here) and without it.
    for tok in [tokenizer(), tokenizer().with_cache(0)] {
        every_golden_turn(&tok);
    }
}

fn every_golden_turn(tok: &ChatTokenizer) {
    let golden = golden();
    assert_eq!(golden.len(), 6);
    for turn in &golden {
        let expected = ids(&turn["tokenize"]);
        let got = tok.chat(&chat_body(&turn["messages"])).expect("tokenize");
        assert!(got.complete);
        assert_eq!(
            got.ids, expected,
            "conversation {} turn {}",
            turn["conversation"], turn["turn"]
        );
        assert_eq!(
            got.ids.len() as u64,
            turn["prompt_tokens"].as_u64().unwrap()
        );
    }
}

#[test]
fn content_parts_join_as_vllm_joins_them() {
    // This template prints content only when it is a string, so vLLM hands it parts joined by
    // "\n": a one-part list is the same as the string.
    let tok = tokenizer();
    let turn = &golden()[0];
    let mut messages = turn["messages"].clone();
    for m in messages.as_array_mut().unwrap() {
        let text = m["content"].as_str().unwrap().to_string();
        m["content"] = json!([{"type": "text", "text": text}]);
    }
    let got = tok.chat(&chat_body(&messages)).unwrap();
    assert_eq!(got.ids, ids(&turn["tokenize"]));
}

#[test]
fn a_later_turn_starts_with_the_earlier_turns_tokens() {
    // This template renders each message the same whatever follows it, so turn n's text up to
    // its generation prompt ("<|assistant|>\n", 9 tokens here) leads turn n+1's text; and
    // what precedes it ends in "</s>\n", where this tokenizer's pre-tokens end whatever
    // follows: the tokens before the generation prompt lead turn n+1's.
    let tok = tokenizer();
    let golden = golden();
    for pair in golden.windows(2) {
        if pair[0]["conversation"] != pair[1]["conversation"] {
            continue;
        }
        let a = tok.chat(&chat_body(&pair[0]["messages"])).unwrap().ids;
        let b = tok.chat(&chat_body(&pair[1]["messages"])).unwrap().ids;
        let shared = a.len() - 9;
        assert_eq!(a[..shared], b[..shared]);
        assert_eq!(a[shared..], [31, 95, 319, 505, 268, 1080, 95, 33, 202]);
    }
}

#[test]
fn the_piece_cache_serves_the_next_turn_and_changes_no_id() {
    let cached = tokenizer();
    let plain = tokenizer().with_cache(0);
    assert!(plain.cache_stats().is_none());
    // The golden conversations with a system prompt 40 times longer (~15 KB): several pieces.
    for conversation in ["A", "B"] {
        let mut earlier_misses = None;
        for turn in golden()
            .iter()
            .filter(|t| t["conversation"] == conversation)
        {
            let mut messages = turn["messages"].clone();
            let system = messages[0]["content"].as_str().unwrap().repeat(40);
            messages[0]["content"] = json!(system);
            let body = chat_body(&messages);
            let got = cached.chat(&body).unwrap();
            assert_eq!(got, plain.chat(&body).unwrap());
            let (hits, misses, _) = cached.cache_stats().unwrap();
            if let Some((hits_before, misses_before)) = earlier_misses {
                // Most pieces came from the cache; the new tail was tokenized.
                assert!(hits - hits_before >= 5, "{hits} {hits_before}");
                assert!(misses - misses_before <= 2, "{misses} {misses_before}");
            }
            earlier_misses = Some((hits, misses));
        }
    }
    // Asked again, a whole request is served from the cache.
    let body = chat_body(&golden()[0]["messages"]);
    let first = cached.chat(&body).unwrap();
    let (_, misses, _) = cached.cache_stats().unwrap();
    assert_eq!(cached.chat(&body).unwrap(), first);
    assert_eq!(cached.cache_stats().unwrap().1, misses);
}

#[test]
fn generation_prompt_and_special_tokens_follow_the_body() {
    let tok = tokenizer();
    let turn = &golden()[0];
    let expected = ids(&turn["tokenize"]);
    let body = serde_json::to_vec(&json!({
        "messages": turn["messages"], "add_generation_prompt": false
    }))
    .unwrap();
    let got = tok.chat(&body).unwrap();
    // "<|assistant|>\n" is 9 tokens here: 31 95 319 505 268 1080 95 33 202.
    assert_eq!(got.ids[..], expected[..expected.len() - 9]);
    // The post-processor of this tokenizer adds nothing, so add_special_tokens changes nothing.
    let body = serde_json::to_vec(&json!({
        "messages": turn["messages"], "add_special_tokens": true
    }))
    .unwrap();
    assert_eq!(tok.chat(&body).unwrap().ids, expected);
}

#[test]
fn completions_prompt_has_no_bos_with_this_post_processor() {
    // tokenizer.json's post-processor is TemplateProcessing "$A" with no special tokens and the
    // config sets no add_bos_token: vLLM's completions path adds nothing to the prompt's ids.
    let tok = tokenizer();
    let text = "turn 0: alpha prefix beta";
    let plain = tok.prompt(text, true).unwrap();
    assert_ne!(plain.ids.first(), Some(&1));
    let body = serde_json::to_vec(&json!({"model": "m", "prompt": text})).unwrap();
    assert_eq!(tok.completion(&body).unwrap().ids, plain.ids);
    let body = serde_json::to_vec(&json!({"prompt": [1, 31, 95]})).unwrap();
    assert_eq!(tok.completion(&body).unwrap().ids, [1, 31, 95]);
    // The chat text rendered as a prompt gives the chat's ids (the template wrote "<s>").
    let turn = &golden()[0];
    let (rendered, _) = tok.render_chat(&chat_body(&turn["messages"])).unwrap();
    assert!(rendered.starts_with("<s><|system|>\n"));
    assert_eq!(
        tok.prompt(&rendered, true).unwrap().ids,
        ids(&turn["tokenize"])
    );
}

#[test]
fn capped_tokens_are_the_exact_leading_tokens() {
    let golden = golden();
    let full = tokenizer();
    // One tokenizer, its limits set and its piece cache emptied before each request: what a
    // freshly loaded one would answer, without parsing its files a thousand times.
    let mut tok = tokenizer();
    for turn in &golden {
        let body = chat_body(&turn["messages"]);
        let expected = ids(&turn["tokenize"]);
        let (text, _) = full.render_chat(&body).unwrap();
        for max_bytes in (0..text.len()).step_by(7) {
            tok = tok.with_limits(Limits {
                max_bytes,
                max_tokens: usize::MAX,
            });
            tok.clear_cache();
            let got = tok.chat(&body).unwrap();
            assert!(!got.complete);
            assert_eq!(
                got.ids[..],
                expected[..got.ids.len()],
                "max_bytes {max_bytes}"
            );
            // The cut is never far behind the cap on this English text (a word or a turn).
            if max_bytes > 64 {
                assert!(
                    got.ids.len() * 2 + 40 >= max_bytes / 2,
                    "max_bytes {max_bytes}"
                );
            }
        }
        for max_tokens in [0, 1, 100, expected.len() - 1] {
            tok = tok.with_limits(Limits {
                max_bytes: usize::MAX,
                max_tokens,
            });
            tok.clear_cache();
            let got = tok.chat(&body).unwrap();
            assert_eq!(got.ids[..], expected[..max_tokens]);
            assert!(!got.complete);
        }
    }
}

#[test]
fn garbage_bodies_are_errors_not_panics() {
    let tok = tokenizer();
    for body in [
        &b""[..],
        b"{",
        b"[]",
        b"{\"messages\": 3}",
        b"{\"messages\": [3]}",
        b"{\"messages\": [{\"content\": \"no role\"}]}",
        b"{\"messages\": [{\"role\": \"user\", \"content\": 5}]}",
        b"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}",
        b"{\"messages\": [], \"add_generation_prompt\": true, \"continue_final_message\": true}",
        b"{\"messages\": [{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"function\": {\"arguments\": \"{bad\"}}]}]}",
    ] {
        let err = tok.chat(body).expect_err("refused");
        assert!(matches!(err, TokenizeError::Body(_)), "{err}");
    }
    for body in [
        &b"{}"[..],
        b"{\"prompt\": 3}",
        b"{\"prompt\": [\"a\", \"b\"]}",
        b"{\"prompt\": [-1]}",
    ] {
        assert!(matches!(tok.completion(body), Err(TokenizeError::Body(_))));
    }
}

#[test]
fn load_errors_name_the_file() {
    let dir = std::env::temp_dir().join(format!("rankgate-tokenize-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let err = ChatTokenizer::from_dir(&dir).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");

    std::fs::write(dir.join("tokenizer.json"), "{\"not\": \"a tokenizer\"}").unwrap();
    let err = ChatTokenizer::from_dir(&dir).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer.json") && err.contains("not a tokenizer"),
        "{err}"
    );

    std::fs::copy(
        fixture_dir().join("tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), "{\"chat_template\": 1}").unwrap();
    let err = ChatTokenizer::from_dir(&dir).unwrap_err().to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("chat_template"),
        "{err}"
    );

    // No template at all: loading works (completions), chat requests say why they cannot.
    std::fs::write(
        dir.join("tokenizer_config.json"),
        "{\"bos_token\": \"<s>\"}",
    )
    .unwrap();
    let tok = ChatTokenizer::from_dir(&dir).unwrap();
    let err = tok.chat(b"{\"messages\": []}").unwrap_err();
    assert!(matches!(err, TokenizeError::NoTemplate { .. }), "{err}");

    std::fs::write(dir.join("chat_template.jinja"), "{% for m in messages %}").unwrap();
    let err = ChatTokenizer::from_dir(&dir).unwrap_err().to_string();
    assert!(err.contains("chat_template.jinja"), "{err}");

    // A template that refuses a conversation: a Raised error with its message.
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}",
    )
    .unwrap();
    let tok = ChatTokenizer::from_dir(&dir).unwrap();
    let err = tok
        .chat(b"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}")
        .unwrap_err();
    assert!(
        matches!(&err, TokenizeError::Raised { message, .. } if message == "system first"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn explicit_files_and_a_config_template() {
    // The template given in tokenizer_config.json instead of its own file, and add_bos_token.
    let dir = std::env::temp_dir().join(format!("rankgate-tokenize-cfg-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let template = std::fs::read_to_string(fixture_dir().join("chat_template.jinja")).unwrap();
    let config = json!({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true,
        "chat_template": template});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let files = TokenizerFiles {
        tokenizer: fixture_dir().join("tokenizer.json"),
        config: Some(dir.join("tokenizer_config.json")),
        chat_template: None,
    };
    let tok = ChatTokenizer::from_files(&files).unwrap();
    let turn = &golden()[2];
    assert_eq!(
        tok.chat(&chat_body(&turn["messages"])).unwrap().ids,
        ids(&turn["tokenize"])
    );
    assert_eq!(tok.prompt("alpha", true).unwrap().ids.first(), Some(&1));
    assert_ne!(tok.prompt("alpha", false).unwrap().ids.first(), Some(&1));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A one-route `/tokenize` server on 127.0.0.1:0 that answers with the golden ids of the
/// conversation it is sent, and records the body.
async fn tokenize_server() -> (String, tokio::sync::mpsc::UnboundedReceiver<Value>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (seen, bodies) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        // Bounded: the tests make at most a few requests.
        for _ in 0..8 {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let seen = seen.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: hyper::Request<Incoming>| {
                    let seen = seen.clone();
                    async move {
                        let path = req.uri().path().to_string();
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                        let _ = seen.send(body.clone());
                        let answer = if path != "/tokenize" {
                            hyper::Response::builder()
                                .status(404)
                                .body(Full::new(Bytes::from("no")))
                        } else if body["model"] == "refuse" {
                            hyper::Response::builder()
                                .status(400)
                                .body(Full::new(Bytes::from("{\"error\": \"bad\"}")))
                        } else {
                            let turn = golden()
                                .into_iter()
                                .find(|t| t["messages"] == body["messages"])
                                .unwrap_or_else(|| json!({"tokenize": [7, 8]}));
                            let tokens = turn["tokenize"].clone();
                            let out = json!({"count": tokens.as_array().unwrap().len(),
                                "max_model_len": 2048, "tokens": tokens, "token_strs": null});
                            hyper::Response::builder().body(Full::new(Bytes::from(out.to_string())))
                        };
                        Ok::<_, Infallible>(answer.unwrap())
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (base, bodies)
}

#[tokio::test]
async fn engine_tokenize_fallback_matches_the_local_tokenizer() {
    let (base, mut bodies) = tokenize_server().await;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let turn = &golden()[4];
    let body = serde_json::to_vec(&json!({"model": "tiny-llama", "messages": turn["messages"],
        "stream": true, "max_tokens": 16}))
    .unwrap();
    let answer = engine_tokenize(
        &client,
        &base,
        TokenizeRequest::Chat,
        &body,
        Duration::from_secs(5),
    )
    .await
    .expect("engine answer");
    assert_eq!(answer.tokens, tokenizer().chat(&body).unwrap().ids);
    assert_eq!(answer.count, Some(answer.tokens.len() as u64));
    assert_eq!(answer.max_model_len, Some(2048));
    assert!(answer.latency < Duration::from_secs(5));
    // Only the fields that change the tokens were sent.
    let sent = bodies.recv().await.unwrap();
    assert_eq!(
        sent,
        json!({"model": "tiny-llama", "messages": turn["messages"]})
    );

    let refused = engine_tokenize(
        &client,
        &base,
        TokenizeRequest::Completion,
        br#"{"model": "refuse", "prompt": "x"}"#,
        Duration::from_secs(5),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(
        refused.contains("/tokenize") && refused.contains("400"),
        "{refused}"
    );
}

#[tokio::test]
async fn engine_tokenize_names_an_unreachable_engine() {
    // A port that was just free: nothing listens there.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let err = engine_tokenize(
        &client,
        &base,
        TokenizeRequest::Completion,
        br#"{"prompt": "x"}"#,
        Duration::from_secs(5),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains(&base), "{err}");
}
