//! Pinning a request to its rank: the header for every flavor, the body field for SGLang, and the
//! hop-by-hop headers that never cross the proxy.

use std::io::Write;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use super::error::ProxyError;

/// SGLang body fields that pin a rank (older and newer name); a client's own are replaced.
const SGLANG_RANK_FIELDS: [&str; 2] = ["data_parallel_rank", "routed_dp_rank"];

/// Headers that describe one hop, not the message, and so are never forwarded. A `static`:
/// a `const` array would be built and dropped at every use.
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

pub fn strip_hop_by_hop(h: &mut HeaderMap) {
    // Most messages carry none: one look at the few names present finds that, where removing
    // each listed name would hash all eight.
    if !h.keys().any(|n| HOP_BY_HOP.contains(n)) {
        return;
    }
    // Headers the Connection header names are hop-by-hop too. Its values are taken out first
    // so the names they list can be removed while reading them (by `&str`: no allocation).
    // The usual single value needs no list of its own.
    if h.get_all(header::CONNECTION).iter().nth(1).is_none() {
        if let Some(v) = h.remove(header::CONNECTION) {
            remove_listed(h, &v);
        }
    } else {
        let listed: Vec<HeaderValue> = h.get_all(header::CONNECTION).iter().cloned().collect();
        for v in &listed {
            remove_listed(h, v);
        }
    }
    // What is left is usually nothing: remove the names still present, each found by a look at
    // the few names there are rather than a hashed removal of all eight.
    while let Some(n) = h.keys().find(|n| HOP_BY_HOP.contains(n)).cloned() {
        h.remove(&n);
    }
}

/// Headers a `Connection` header cannot remove: the message's own framing and type, and the
/// headers rankgate itself relies on. A sender must not list them (RFC 9110, 7.6.1); a client
/// that does gets them forwarded anyway, rather than an engine told less than it needs.
/// (`Transfer-Encoding` is hop-by-hop in any case, and `Host` rewritten for the engine.)
static NEVER_LISTED: [HeaderName; 4] = [
    header::CONTENT_TYPE,
    header::CONTENT_LENGTH,
    header::CONTENT_ENCODING,
    header::HOST,
];

/// Removes the headers a Connection header value names, except [`NEVER_LISTED`].
fn remove_listed(h: &mut HeaderMap, connection: &HeaderValue) {
    // What HTTP/1.1 clients and servers nearly always send names no header (`close`) or one
    // on the hop-by-hop list anyway (`keep-alive`): nothing to look up by name.
    let v = connection.as_bytes().trim_ascii();
    if v.eq_ignore_ascii_case(b"keep-alive") || v.eq_ignore_ascii_case(b"close") {
        return;
    }
    for name in connection.to_str().into_iter().flat_map(|v| v.split(',')) {
        let Ok(name) = HeaderName::from_bytes(name.trim().as_bytes()) else {
            continue;
        };
        if !NEVER_LISTED.contains(&name) {
            h.remove(name);
        }
    }
}

/// Checks that `body` is one valid JSON object, building nothing: a body about to be copied
/// member by member as written (values stepped over, not parsed) must be known valid first.
pub fn json_object(body: &[u8]) -> Result<(), ProxyError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first.is_some() && first != Some(&b'{') {
        // Valid JSON that is not an object says so; invalid JSON gets the parser's message.
        return match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
            Ok(_) => Err(ProxyError::NotObject),
            Err(e) => Err(ProxyError::BadJson(e.to_string())),
        };
    }
    // Validated whole (building nothing), then copied member by member as written: a parse
    // into keys and raw values, re-escaped, cost five times as much on a small chat.
    serde_json::from_slice::<serde::de::IgnoredAny>(body)
        .map_err(|e| ProxyError::BadJson(e.to_string()))?;
    Ok(())
}

/// Writes the rank into an SGLang request body, replacing any rank the client set.
///
/// Only the top level is parsed: each member's value is kept as its raw JSON text and copied
/// through, so a long prompt is validated but never built into a tree and printed again.
pub fn pin_in_body(body: &[u8], rank: u32) -> Result<Bytes, ProxyError> {
    with_member(body, &SGLANG_RANK_FIELDS, rank)
}

/// Writes the top-level member `name` of a JSON object body as `value`, replacing the client's
/// (flow control's `priority`), the rest copied through as [`pin_in_body`] does.
pub fn set_member(body: &[u8], name: &str, value: i64) -> Result<Bytes, ProxyError> {
    with_member(body, &[name], value)
}

/// `body` without the members `names`, then `names[0]` set to `value`.
fn with_member(
    body: &[u8],
    names: &[&str],
    value: impl std::fmt::Display,
) -> Result<Bytes, ProxyError> {
    json_object(body)?;
    let mut out = Vec::with_capacity(body.len() + 32);
    out.push(b'{');
    crate::scan::copy_members_except(body, names, &mut out)
        .map_err(|e| ProxyError::BadJson(e.to_string()))?;
    // Writing into a Vec cannot fail.
    let _ = write!(out, "\"{}\":{value}}}", names[0]);
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn pin_in_body_keeps_everything_else_verbatim() {
        let body = br#" {"model":"m","messages":[{"role":"user","content":"a \"quoted\" \u00e9 prompt"}],"max_tokens":8,"data_parallel_rank":3,"stream":true,"x":{"nested":[1,2.5e3,null]}} "#;
        let out = pin_in_body(body, 5).unwrap();
        let got: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let mut want: serde_json::Value = serde_json::from_slice(body).unwrap();
        want["data_parallel_rank"] = 5.into();
        assert_eq!(got, want);
        // Raw values are copied, not re-printed: the escapes survive byte for byte.
        assert!(std::str::from_utf8(&out)
            .unwrap()
            .contains(r#""a \"quoted\" \u00e9 prompt""#));
        assert!(matches!(pin_in_body(b"", 0), Err(ProxyError::BadJson(_))));
        assert!(matches!(
            pin_in_body(b"{\"a\":1} trailing", 0),
            Err(ProxyError::BadJson(_))
        ));
        assert!(matches!(
            pin_in_body(b"\"str\"", 0),
            Err(ProxyError::NotObject)
        ));
    }

    use proptest::prelude::*;

    proptest! {
        /// Whatever the object, the result is the same object with only the rank fields changed.
        #[test]
        fn pin_in_body_is_a_minimal_edit(
            members in proptest::collection::btree_map("[a-z_\"\\\\é ]{0,12}", prop_oneof![
                any::<i64>().prop_map(serde_json::Value::from),
                "[ -~é\n]{0,20}".prop_map(serde_json::Value::from),
                any::<bool>().prop_map(serde_json::Value::from),
            ], 0..8),
            rank in 0u32..1000,
        ) {
            let input = serde_json::Value::Object(members.into_iter().collect());
            let out = pin_in_body(input.to_string().as_bytes(), rank).unwrap();
            let got: serde_json::Value = serde_json::from_slice(&out).unwrap();
            let mut want = input.clone();
            let obj = want.as_object_mut().unwrap();
            obj.remove("routed_dp_rank");
            obj.insert("data_parallel_rank".into(), rank.into());
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn pin_in_body_replaces_client_fields() {
        let out = pin_in_body(
            br#"{"model":"m","data_parallel_rank":7,"routed_dp_rank":7}"#,
            2,
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["data_parallel_rank"], 2);
        assert!(v.get("routed_dp_rank").is_none());
        assert_eq!(v["model"], "m");
        assert!(matches!(pin_in_body(b"[1]", 0), Err(ProxyError::NotObject)));
        assert!(matches!(pin_in_body(b"{", 0), Err(ProxyError::BadJson(_))));
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_go() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert("x-keep", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-keep"));
    }

    #[test]
    fn connection_cannot_remove_the_messages_own_headers() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("Content-Type, content-length,HOST, x-custom"),
        );
        for (k, v) in [
            ("content-type", "application/json"),
            ("content-length", "2"),
            ("host", "h"),
            ("x-custom", "1"),
        ] {
            h.insert(k, HeaderValue::from_static(v));
        }
        strip_hop_by_hop(&mut h);
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort();
        assert_eq!(left, ["content-length", "content-type", "host"]);
    }

    #[test]
    fn the_usual_connection_values_take_their_headers_with_them() {
        for value in ["keep-alive", " Keep-Alive ", "close", "CLOSE"] {
            let mut h = HeaderMap::new();
            h.insert(header::CONNECTION, HeaderValue::from_static(value));
            h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
            h.insert("x-keep", HeaderValue::from_static("1"));
            strip_hop_by_hop(&mut h);
            assert_eq!(h.len(), 1, "{value}: {h:?}");
            assert!(h.contains_key("x-keep"));
        }
    }

    proptest::proptest! {
        /// Whatever the object, the pinned body is that object with every rank field of the
        /// client's replaced by ours, and with the same members otherwise.
        #[test]
        fn the_pinned_body_is_the_object_with_only_its_rank_replaced(
            members in proptest::collection::vec(
                (
                    proptest::prop_oneof![
                        proptest::strategy::Just("data_parallel_rank".to_string()),
                        proptest::strategy::Just("routed_dp_rank".to_string()),
                        "[a-z_\"\\\\é]{0,10}",
                    ],
                    proptest::prop_oneof![
                        proptest::strategy::Just(serde_json::json!(null)),
                        (0u32..9).prop_map(|n| serde_json::json!(n)),
                        "[a-z\"{}\\[\\],: ]{0,12}".prop_map(serde_json::Value::String),
                        proptest::strategy::Just(serde_json::json!({"nested": [1, "a,b", {"c": null}]})),
                    ],
                ),
                0..6,
            ),
            pretty in proptest::bool::ANY,
            rank in 0u32..64,
        ) {
            let object: serde_json::Map<String, serde_json::Value> = members.into_iter().collect();
            let body = match pretty {
                true => serde_json::to_vec_pretty(&object).unwrap(),
                false => serde_json::to_vec(&object).unwrap(),
            };
            let pinned = pin_in_body(&body, rank).unwrap();
            let got: serde_json::Value = serde_json::from_slice(&pinned).unwrap();
            let mut want = object.clone();
            want.remove("routed_dp_rank");
            want.insert("data_parallel_rank".into(), rank.into());
            proptest::prop_assert_eq!(got, serde_json::Value::Object(want));
        }
    }
}
