//! The bodies of a disaggregated request's legs, written from the client's: members copied as
//! the client wrote them (values stepped over, never parsed into a tree), some left out, a few
//! of rankgate's own added. And the KV transfer parameters read from a prefill server's answer.

use bytes::Bytes;

use crate::proxy::error::ProxyError;
use crate::proxy::pin::json_object;
use crate::scan;

/// What steers a KV transfer: vLLM's `kv_transfer_params`, SGLang's bootstrap fields. A
/// client's own never reach an engine: they would let it make a prefill server pin blocks, or a
/// decode server pull blocks of another request from any prefill server.
pub const TRANSFER_FIELDS: [&str; 4] = [
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
];

/// What the prefill leg leaves out of the client's body besides [`TRANSFER_FIELDS`]: its own
/// length and streaming (the leg generates one token, answered whole, since only a whole answer
/// carries the parameters) and what conflicts with one token (`min_tokens`).
const PREFILL_DROPS: [&str; 10] = [
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "min_completion_tokens",
];

/// What a vLLM prefill server is asked for: prefill, keep the blocks for a remote decode.
const PREFILL_PARAMS: &[u8] = br#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// The client's body (checked to be one JSON object) without [`TRANSFER_FIELDS`]: as it came
/// when it has none.
pub fn client_body(body: &Bytes) -> Result<Bytes, ProxyError> {
    json_object(body)?;
    if scan::json_member_raw(body, &TRANSFER_FIELDS)?.is_none() {
        return Ok(body.clone());
    }
    rewrite(body, &TRANSFER_FIELDS, &[])
}

/// vLLM's prefill leg: the client's request for one token, answered whole, with the blocks
/// kept for a remote decode.
pub fn prefill(client: &[u8]) -> Result<Bytes, ProxyError> {
    one_token(client, PREFILL_PARAMS)
}

/// A decode of one token, answered whole, with the prefill server's parameters: what releases
/// the blocks of a request whose client left between the legs (`release`).
pub fn release(client: &[u8], params: &[u8]) -> Result<Bytes, ProxyError> {
    one_token(client, params)
}

/// The client's request for one token, not streamed, with `params` as its
/// `kv_transfer_params`.
fn one_token(client: &[u8], params: &[u8]) -> Result<Bytes, ProxyError> {
    let one = b"1".as_slice();
    let mut add: Vec<(&str, &[u8])> = vec![("max_tokens", one)];
    // Where the client gave it: a chat request with only `max_completion_tokens` would
    // otherwise keep the client's length on the engine.
    if scan::json_member_raw(client, &["max_completion_tokens"])?.is_some_and(|v| v != b"null") {
        add.push(("max_completion_tokens", one));
    }
    add.push(("stream", b"false"));
    add.push(("kv_transfer_params", params));
    rewrite(client, &PREFILL_DROPS, &add)
}

/// vLLM's decode leg: the client's request as it came, with the prefill server's parameters.
pub fn decode(client: &[u8], params: &[u8]) -> Result<Bytes, ProxyError> {
    rewrite(client, &TRANSFER_FIELDS, &[("kv_transfer_params", params)])
}

/// An SGLang leg (both get the same): the client's request with the prefill server's bootstrap
/// address and the request's room.
pub fn bootstrap(client: &[u8], host: &str, port: u16, room: u64) -> Result<Bytes, ProxyError> {
    let host = serde_json::to_vec(host).map_err(|e| ProxyError::Internal(e.to_string()))?;
    let (port, room) = (port.to_string(), room.to_string());
    rewrite(
        client,
        &TRANSFER_FIELDS,
        &[
            ("bootstrap_host", &host),
            ("bootstrap_port", port.as_bytes()),
            ("bootstrap_room", room.as_bytes()),
        ],
    )
}

/// The `kv_transfer_params` object of a prefill server's answer, as it wrote it.
pub fn params(answer: &[u8]) -> Result<&[u8], ProxyError> {
    let unreadable = |why: String| ProxyError::PrefillAnswer(why);
    let raw = scan::json_member_raw(answer, &["kv_transfer_params"])
        .map_err(|e| unreadable(e.to_string()))?;
    let raw = match raw {
        None => return Err(ProxyError::PrefillNoParams),
        Some(v) if v == b"null" => return Err(ProxyError::PrefillNoParams),
        Some(v) => v,
    };
    // Copied verbatim into the decode's body: it must be one valid object.
    if raw.first() != Some(&b'{') {
        return Err(unreadable("kv_transfer_params is not an object".into()));
    }
    serde_json::from_slice::<serde::de::IgnoredAny>(raw)
        .map_err(|e| unreadable(format!("kv_transfer_params: {e}")))?;
    Ok(raw)
}

/// Where a decode pulls from, by the parameters (`<remote_engine_id>:<remote_port>`), for the
/// access log: with DP the engine id names the prefill rank (`..._dp1`).
pub fn kv_source(params: &[u8]) -> Option<std::sync::Arc<str>> {
    let engine = scan::json_member(params, "remote_engine_id").ok()??;
    let port = scan::json_member_raw(params, &["remote_port"]).ok()??;
    let port = std::str::from_utf8(port).ok()?;
    Some(format!("{engine}:{port}").into())
}

/// `body` (a valid JSON object) without the members `drop` names, with `add`'s members (raw
/// JSON values) after the rest.
fn rewrite(body: &[u8], drop: &[&str], add: &[(&str, &[u8])]) -> Result<Bytes, ProxyError> {
    let extra: usize = add.iter().map(|(k, v)| k.len() + v.len() + 4).sum();
    let mut out = Vec::with_capacity(body.len() + extra + 2);
    out.push(b'{');
    scan::copy_members_except(body, drop, &mut out)?;
    for (key, value) in add {
        out.push(b'"');
        out.extend_from_slice(key.as_bytes());
        out.extend_from_slice(b"\":");
        out.extend_from_slice(value);
        out.push(b',');
    }
    // Every member ends with a comma: the last one's becomes the closing brace.
    match out.last_mut() {
        Some(last @ b',') => *last = b'}',
        _ => out.push(b'}'),
    }
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    fn parse(b: &[u8]) -> Value {
        serde_json::from_slice(b).unwrap()
    }

    #[test]
    fn the_prefill_leg_asks_for_one_token_answered_whole() {
        let client = json!({
            "model": "m", "messages": [{"role": "user", "content": "a \"quoted\" prompt"}],
            "max_tokens": 64, "max_completion_tokens": 64, "stream": true,
            "stream_options": {"include_usage": true}, "min_tokens": 4, "temperature": 0,
            "kv_transfer_params": {"remote_host": "10.0.0.9"}, "bootstrap_room": 7
        });
        let body = prefill(client.to_string().as_bytes()).unwrap();
        let got = parse(&body);
        assert_eq!(
            got,
            json!({
                "model": "m", "messages": [{"role": "user", "content": "a \"quoted\" prompt"}],
                "temperature": 0, "max_tokens": 1, "max_completion_tokens": 1, "stream": false,
                "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                    "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
                    "remote_port": null}
            })
        );
        // Only where the client gave it.
        let got = parse(&prefill(br#"{"prompt":"p"}"#).unwrap());
        assert!(got.get("max_completion_tokens").is_none());
        assert_eq!(got["max_tokens"], 1);
    }

    #[test]
    fn the_decode_leg_is_the_clients_body_with_the_prefill_servers_params() {
        let client = br#"{"model":"m","prompt":"p","stream":true,"max_tokens":9,"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"evil"}}"#;
        let params =
            br#"{"do_remote_prefill":true,"remote_block_ids":[[1,2]],"remote_port":33110}"#;
        let got = parse(&decode(client, params).unwrap());
        assert_eq!(
            got,
            json!({"model": "m", "prompt": "p", "stream": true, "max_tokens": 9,
                "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [[1, 2]],
                "remote_port": 33110}})
        );
    }

    #[test]
    fn a_clients_transfer_fields_never_pass() {
        let body = Bytes::from_static(
            br#"{"model":"m","bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":2,"kv_transfer_params":null,"x":1}"#,
        );
        assert_eq!(
            parse(&client_body(&body).unwrap()),
            json!({"model": "m", "x": 1})
        );
        let plain = Bytes::from_static(br#"{"model":"m"}"#);
        assert_eq!(client_body(&plain).unwrap(), plain);
        assert!(matches!(
            client_body(&Bytes::from_static(b"[1]")),
            Err(ProxyError::NotObject)
        ));
        assert!(matches!(
            client_body(&Bytes::from_static(b"{\"a\":")),
            Err(ProxyError::BadJson(_))
        ));
        let got = parse(&bootstrap(&body, "10.0.0.1", 8998, 1 << 62).unwrap());
        assert_eq!(
            got,
            json!({"model": "m", "x": 1, "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998,
                "bootstrap_room": 1u64 << 62})
        );
    }

    #[test]
    fn a_prefill_answer_gives_its_params_or_says_why_not() {
        let fixture =
            include_bytes!("../../../../../tests/fixtures/vllm-0.32-pd/router-prefill-answer.json");
        let raw = params(fixture).unwrap();
        assert_eq!(kv_source(raw).as_deref(), Some("pd4-P:33110"));
        let p = parse(raw);
        assert_eq!(p["do_remote_prefill"], true);
        assert_eq!(p["remote_engine_id"], "pd4-P");
        assert!(matches!(
            params(br#"{"id":"x","kv_transfer_params":null}"#),
            Err(ProxyError::PrefillNoParams)
        ));
        assert!(matches!(
            params(br#"{"id":"x"}"#),
            Err(ProxyError::PrefillNoParams)
        ));
        for bad in [
            &br#"{"kv_transfer_params":[1]}"#[..],
            br#"{"kv_transfer_params":{"a":}"#,
            b"<html>",
            b"",
        ] {
            assert!(
                matches!(params(bad), Err(ProxyError::PrefillAnswer(_))),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    proptest::proptest! {
        /// Whatever the client's object, the decode leg's body is that object without its
        /// transfer fields, with the prefill server's parameters.
        #[test]
        fn legs_are_the_clients_object_with_only_the_transfer_fields_changed(
            members in proptest::collection::btree_map(
                proptest::prop_oneof![
                    proptest::strategy::Just("kv_transfer_params".to_string()),
                    proptest::strategy::Just("bootstrap_room".to_string()),
                    proptest::strategy::Just("stream".to_string()),
                    "[a-z_\"\\\\é]{0,10}",
                ],
                proptest::prop_oneof![
                    proptest::strategy::Just(json!(null)),
                    (0u32..9).prop_map(|n| json!(n)),
                    "[a-z\"{}\\[\\],: ]{0,12}".prop_map(Value::String),
                    proptest::strategy::Just(json!({"nested": [1, "a,b", {"c": null}]})),
                ],
                0..6,
            ),
        ) {
            let object = Value::Object(members.into_iter().collect());
            let body = serde_json::to_vec(&object).unwrap();
            let got = parse(&decode(&body, br#"{"p":1}"#).unwrap());
            let mut want = object.as_object().unwrap().clone();
            for f in TRANSFER_FIELDS {
                want.remove(f);
            }
            want.insert("kv_transfer_params".into(), json!({"p": 1}));
            proptest::prop_assert_eq!(got, Value::Object(want));
        }
    }
}
