use super::*;

#[test]
fn sse_tokens_across_frames() {
    let mut s = SseTokens::default();
    assert_eq!(s.feed(b"data: {\"choices\":[{\"delta\":{}}]}\n\nda"), 1);
    assert_eq!(s.feed(b"ta: {\"choices\":[{}]}\n"), 0);
    assert_eq!(
        s.feed(b"\ndata: {\"choices\":[],\"usage\":{}}\n\ndata: [DONE]\n\n"),
        1
    );
    assert_eq!(s.ending(false), None, "[DONE] came");
    assert_eq!(
        s.ending(true),
        Some(ErrorKind::StreamCut),
        "then the body broke"
    );
}

#[test]
fn a_stream_is_ok_only_when_it_reached_done_without_an_error_event() {
    let token = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n";
    let mut cut = SseTokens::default();
    assert_eq!(cut.feed(token), 1);
    assert_eq!(cut.ending(false), Some(ErrorKind::StreamCut), "no [DONE]");

    let mut errored = SseTokens::default();
    let event = b"data: {\"error\":{\"message\":\"cut\",\"type\":\"UpstreamError\"}}\n\n";
    assert_eq!(
        errored.feed(token) + errored.feed(event),
        1,
        "an error is no token"
    );
    assert_eq!(errored.feed(b"data: [DONE]\n\n"), 0);
    assert_eq!(errored.ending(false), Some(ErrorKind::StreamErrorEvent));

    let mut engine_error = SseTokens::default();
    let vllm = b"data: {\"object\":\"error\",\"message\":\"x\",\"code\":500}\n\n";
    assert_eq!(engine_error.feed(vllm), 0);
    assert_eq!(
        engine_error.ending(false),
        Some(ErrorKind::StreamErrorEvent)
    );
}
