//! A vLLM prefill server's `kv_transfer_params`, checked before any decode server sees them.
//! They tell the decode where to pull the KV from (`remote_host`, `remote_port`) and what
//! (`remote_engine_id`, `remote_block_ids`): copied unchecked, a prefill server that is broken,
//! compromised or not what it claims would make the decode connect anywhere. So:
//!
//! - `remote_host` must be the prefill server's own: its url's host, an address that host
//!   resolves to (looked up only when the parameters name an IP address and the url a name,
//!   the answer kept for [`RESOLVED_FOR`]), `localhost` or a loopback address when its url is on
//!   loopback (vLLM's `VLLM_NIXL_SIDE_CHANNEL_HOST` defaults to `localhost`), or one of its
//!   `engines[].kv_hosts`. Never resolved itself: a name the engine chose is never looked up.
//! - `remote_port` an integer in 1..=65535; the flags booleans; the counts non-negative
//!   integers; the ids strings of bounded length; `remote_block_ids` non-negative integers
//!   (flat, or one list per KV group), at most [`MAX_BLOCK_IDS`] in all.
//! - Members rankgate does not know (vLLM adds some in most releases) pass when they are
//!   scalars or short lists of scalars of bounded size, except one whose name says it is a
//!   place (`host`, `addr`, `url`, `endpoint`, `_ip`): a place rankgate cannot check is refused.
//!
//! What the decode gets is written from the checked members (a duplicated member is one
//! value, the one checked). A refusal is the prefill leg's failure (`bad_params`), answered
//! 502 without the values (`exposure.rs`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{Map, Value};

use crate::config::Engine;
use crate::proxy::error::ProxyError;

/// The most members the parameters may have (vLLM 0.32 writes 14).
pub const MAX_MEMBERS: usize = 64;
/// The most block ids in `remote_block_ids` (a 1 MiB answer holds fewer anyway).
pub const MAX_BLOCK_IDS: usize = 1_000_000;
/// The longest id string (`remote_engine_id`, `remote_request_id`, an unknown member's).
pub const MAX_STRING: usize = 1024;
/// The most items in an unknown member's list.
pub const MAX_LIST: usize = 4096;
/// How long an engine host's addresses are believed once looked up.
pub const RESOLVED_FOR: Duration = Duration::from_secs(30);
/// How long a lookup of an engine's host may take before the parameters are refused.
const LOOKUP_WITHIN: Duration = Duration::from_secs(2);
/// Hosts whose addresses are kept at once; past it the list starts over.
const MAX_RESOLVED: usize = 4096;

type Resolved = HashMap<Arc<str>, (Instant, Arc<[IpAddr]>)>;
static RESOLVED: Mutex<Option<Resolved>> = Mutex::new(None);

/// The parameters the prefill leg read (`raw`, or its error), checked for `engine`: the bytes
/// the decode gets, or why not.
pub async fn checked(raw: Result<Bytes, ProxyError>, engine: &Engine) -> Result<Bytes, ProxyError> {
    let raw = raw?;
    let members: Map<String, Value> = serde_json::from_slice(&raw).map_err(|e| {
        refused(
            "they are not one JSON object",
            format!("kv_transfer_params: {e}"),
        )
    })?;
    let host = shape(&members)?;
    if let Some(host) = host {
        host_allowed(host, engine).await?;
    }
    serde_json::to_vec(&members)
        .map(Bytes::from)
        .map_err(|e| ProxyError::Internal(e.to_string()))
}

fn refused(why: &'static str, detail: String) -> ProxyError {
    ProxyError::PrefillBadParams { why, detail }
}

/// Checks every member's type and size; the `remote_host` to check, when there is one.
fn shape(members: &Map<String, Value>) -> Result<Option<&str>, ProxyError> {
    if members.len() > MAX_MEMBERS {
        return Err(refused(
            "too many members",
            format!("{} members, at most {MAX_MEMBERS}", members.len()),
        ));
    }
    let mut host = None;
    for (name, value) in members {
        let bad = |why: &'static str| refused(why, format!("member {:?}: {why}", clip(name)));
        match (name.as_str(), value) {
            (_, Value::Null) => {}
            ("remote_host", Value::String(h)) if h.len() <= 253 => host = Some(h.as_str()),
            ("remote_host", _) => return Err(bad("remote_host is not a host name or address")),
            ("remote_port", v) => match v.as_u64() {
                Some(1..=65535) => {}
                _ => return Err(bad("remote_port is not a port (1 to 65535)")),
            },
            ("do_remote_prefill" | "do_remote_decode", Value::Bool(_)) => {}
            ("do_remote_prefill" | "do_remote_decode", _) => {
                return Err(bad("a flag is not true or false"))
            }
            (
                "tp_size"
                | "dcp_size"
                | "pp_size"
                | "remote_num_tokens"
                | "remote_prefill_cached_tokens",
                v,
            ) if v.is_u64() => {}
            (
                "tp_size"
                | "dcp_size"
                | "pp_size"
                | "remote_num_tokens"
                | "remote_prefill_cached_tokens",
                _,
            ) => return Err(bad("a count is not a non-negative integer")),
            ("remote_blocks_expiry_time", Value::Number(_)) => {}
            ("remote_blocks_expiry_time", _) => return Err(bad("an expiry time is not a number")),
            ("remote_block_ids", v) => {
                block_ids(v).map_err(|_| bad("remote_block_ids are not block ids"))?
            }
            (_, Value::String(s)) if s.len() <= MAX_STRING && !is_place(name) => {}
            (_, Value::String(_)) if is_place(name) => {
                return Err(bad("a member names a place rankgate cannot check"))
            }
            (_, Value::Bool(_) | Value::Number(_)) => {}
            (_, Value::Array(items))
                if !is_place(name) && items.len() <= MAX_LIST && items.iter().all(small_scalar) => {
            }
            _ if is_place(name) => return Err(bad("a member names a place rankgate cannot check")),
            _ => return Err(bad("a member is too large or nested")),
        }
        if name.len() > 64 {
            return Err(bad("a member's name is too long"));
        }
    }
    Ok(host)
}

/// A member name that says it holds a place the decode would connect to.
fn is_place(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.ends_with("_ip")
        || ["host", "addr", "url", "endpoint"]
            .iter()
            .any(|p| n.contains(p))
}

fn small_scalar(v: &Value) -> bool {
    match v {
        Value::String(s) => s.len() <= MAX_STRING,
        Value::Array(_) | Value::Object(_) => false,
        _ => true,
    }
}

/// `remote_block_ids`: non-negative integers, flat or one list per KV group, at most
/// [`MAX_BLOCK_IDS`].
fn block_ids(v: &Value) -> Result<(), ()> {
    let Value::Array(outer) = v else {
        return Err(());
    };
    let mut n = 0usize;
    for item in outer {
        match item {
            Value::Array(inner) => {
                n += inner.len();
                if !inner.iter().all(Value::is_u64) {
                    return Err(());
                }
            }
            v if v.is_u64() => n += 1,
            _ => return Err(()),
        }
        if n > MAX_BLOCK_IDS {
            return Err(());
        }
    }
    Ok(())
}

/// At most 64 characters of an engine's text, for the operator's log.
fn clip(s: &str) -> &str {
    match s.char_indices().nth(64) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// `host` (as the prefill server wrote it) is the prefill server's own, or listed for it.
async fn host_allowed(host: &str, engine: &Engine) -> Result<(), ProxyError> {
    let wrote = bare(host);
    let own = engine_host(&engine.authority);
    let ip = wrote.parse::<IpAddr>().ok();
    let loopback = |h: &str| h == "localhost" || h.parse::<IpAddr>().is_ok_and(|a| a.is_loopback());
    if wrote == own
        || engine.kv_hosts.iter().any(|h| **h == *wrote)
        || (loopback(&own) && loopback(&wrote))
    {
        return Ok(());
    }
    // The url names a host and the parameters an address: the host's addresses are the
    // engine's own.
    if let (Some(ip), Err(_)) = (ip, own.parse::<IpAddr>()) {
        match resolve(&own).await {
            Ok(addrs) if addrs.iter().any(|a| canonical(*a) == canonical(ip)) => return Ok(()),
            Ok(_) => {}
            Err(e) => {
                return Err(refused(
                    "remote_host could not be checked",
                    format!("remote_host {:?}: looking up the prefill server's host {own:?}: {e}; list the address in its engines[].kv_hosts", clip(host)),
                ))
            }
        }
    }
    Err(refused(
        "remote_host is not the prefill server's address",
        format!(
            "remote_host {:?} is neither the host of the prefill server's url ({own}), an address it resolves to, nor one of its engines[].kv_hosts",
            clip(host)
        ),
    ))
}

/// A host as compared: lowercase, IPv6 without brackets, an IPv4-mapped IPv6 address as IPv4.
fn bare(host: &str) -> String {
    let h = host.trim().trim_start_matches('[').trim_end_matches(']');
    match h.parse::<IpAddr>() {
        Ok(a) => canonical(a).to_string(),
        Err(_) => h.to_ascii_lowercase(),
    }
}

fn canonical(a: IpAddr) -> IpAddr {
    match a {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(a, IpAddr::V4),
        a => a,
    }
}

/// The host of an engine's `host:port` authority, as [`bare`] writes it.
fn engine_host(authority: &str) -> String {
    let host = match authority.parse::<http::uri::Authority>() {
        Ok(a) => a.host().to_string(),
        Err(_) => authority
            .rsplit_once(':')
            .map_or(authority, |(h, _)| h)
            .to_string(),
    };
    bare(&host)
}

/// `host`'s addresses, looked up at most once per [`RESOLVED_FOR`].
async fn resolve(host: &str) -> Result<Arc<[IpAddr]>, String> {
    let now = Instant::now();
    {
        let cache = RESOLVED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, addrs)) = cache.as_ref().and_then(|c| c.get(host)) {
            if now.duration_since(*at) < RESOLVED_FOR {
                return Ok(addrs.clone());
            }
        }
    }
    let lookup = tokio::net::lookup_host((host, 0));
    let addrs: Arc<[IpAddr]> = match tokio::time::timeout(LOOKUP_WITHIN, lookup).await {
        Err(_) => return Err(format!("no answer within {} ms", LOOKUP_WITHIN.as_millis())),
        Ok(Err(e)) => return Err(e.to_string()),
        Ok(Ok(found)) => found.map(|s| s.ip()).collect(),
    };
    let mut cache = RESOLVED.lock().unwrap_or_else(|p| p.into_inner());
    let cache = cache.get_or_insert_with(HashMap::new);
    if cache.len() >= MAX_RESOLVED {
        cache.clear();
    }
    cache.insert(host.into(), (now, addrs.clone()));
    Ok(addrs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{test_engine, Role};
    use serde_json::json;

    fn prefill(url: &str, kv_hosts: &[&str]) -> Engine {
        let mut e = test_engine(url, 1, 0);
        e.role = Role::Prefill;
        e.kv_hosts = kv_hosts.iter().map(|h| Arc::from(*h)).collect();
        e
    }

    async fn check(params: Value, engine: &Engine) -> Result<Value, ProxyError> {
        let raw = Bytes::from(serde_json::to_vec(&params).unwrap());
        checked(Ok(raw), engine)
            .await
            .map(|b| serde_json::from_slice(&b).unwrap())
    }

    fn why(r: Result<Value, ProxyError>) -> &'static str {
        match r {
            Err(ProxyError::PrefillBadParams { why, .. }) => why,
            other => panic!("not refused: {other:?}"),
        }
    }

    #[tokio::test]
    async fn real_vllm_params_pass_unchanged() {
        let fixture =
            include_bytes!("../../../../../tests/fixtures/vllm-0.32-pd/router-prefill-answer.json");
        let answer: Value = serde_json::from_slice(fixture).unwrap();
        let params = answer["kv_transfer_params"].clone();
        let engine = prefill("http://127.0.0.1:33010", &[]);
        assert_eq!(check(params.clone(), &engine).await.unwrap(), params);
        // localhost (vLLM's default side-channel host) for an engine on loopback.
        let mut local = params.clone();
        local["remote_host"] = json!("localhost");
        assert!(check(local, &engine).await.is_ok());
    }

    #[tokio::test]
    async fn a_foreign_host_is_refused_unless_listed() {
        let engine = prefill("http://10.0.0.5:8000", &[]);
        let p = |host: &str| json!({"remote_host": host, "remote_port": 5600});
        assert!(check(p("10.0.0.5"), &engine).await.is_ok());
        assert!(check(p("::ffff:10.0.0.5"), &engine).await.is_ok());
        for foreign in [
            "6.6.6.6",
            "localhost",
            "127.0.0.1",
            "10.0.0.50",
            "evil.example",
        ] {
            let r = check(p(foreign), &engine).await;
            assert_eq!(
                why(r),
                "remote_host is not the prefill server's address",
                "{foreign}"
            );
        }
        let listed = prefill("http://10.0.0.5:8000", &["10.1.0.5", "gpu-7.internal"]);
        assert!(check(p("10.1.0.5"), &listed).await.is_ok());
        assert!(check(p("GPU-7.internal"), &listed).await.is_ok());
        assert!(check(p("6.6.6.6"), &listed).await.is_err());
        // A url by name: the addresses it resolves to are its own.
        let named = prefill("http://localhost:8000", &[]);
        assert!(check(p("127.0.0.1"), &named).await.is_ok());
        let v6 = prefill("http://[::1]:8000", &[]);
        assert!(check(p("[::1]"), &v6).await.is_ok());
        assert!(check(p("::2"), &v6).await.is_err());
    }

    #[tokio::test]
    async fn types_and_sizes_are_bounded() {
        let engine = prefill("http://10.0.0.5:8000", &[]);
        let bad = [
            (
                json!({"remote_port": 22222222}),
                "remote_port is not a port (1 to 65535)",
            ),
            (
                json!({"remote_port": 0}),
                "remote_port is not a port (1 to 65535)",
            ),
            (
                json!({"remote_port": "22"}),
                "remote_port is not a port (1 to 65535)",
            ),
            (
                json!({"remote_host": 7}),
                "remote_host is not a host name or address",
            ),
            (
                json!({"do_remote_prefill": "yes"}),
                "a flag is not true or false",
            ),
            (
                json!({"tp_size": -1}),
                "a count is not a non-negative integer",
            ),
            (
                json!({"remote_block_ids": [[1, -2]]}),
                "remote_block_ids are not block ids",
            ),
            (
                json!({"remote_block_ids": [[[1]]]}),
                "remote_block_ids are not block ids",
            ),
            (
                json!({"remote_block_ids": "1,2"}),
                "remote_block_ids are not block ids",
            ),
            (
                json!({"remote_engine_id": "x".repeat(MAX_STRING + 1)}),
                "a member is too large or nested",
            ),
            (
                json!({"new_thing": {"a": 1}}),
                "a member is too large or nested",
            ),
            (
                json!({"peer_url": "http://6.6.6.6/"}),
                "a member names a place rankgate cannot check",
            ),
            (
                json!({"side_channel_ip": "6.6.6.6"}),
                "a member names a place rankgate cannot check",
            ),
            (
                json!({"bootstrap_addr": ["6.6.6.6"]}),
                "a member names a place rankgate cannot check",
            ),
        ];
        for (params, want) in bad {
            assert_eq!(why(check(params.clone(), &engine).await), want, "{params}");
        }
        let many: Map<String, Value> = (0..=MAX_MEMBERS)
            .map(|i| (format!("m{i}"), json!(1)))
            .collect();
        assert_eq!(
            why(check(Value::Object(many), &engine).await),
            "too many members"
        );
        let ids: Vec<u64> = (0..=MAX_BLOCK_IDS as u64).collect();
        let r = check(json!({"remote_block_ids": [ids]}), &engine).await;
        assert_eq!(why(r), "remote_block_ids are not block ids");
        // Unknown scalars and short lists pass; nulls too, a place that is null included.
        let ok = json!({"transfer_mode": "pull", "new_flag": true, "new_list": [1, "a"],
            "remote_block_ids": [1, 2], "remote_host": null, "peer_url": null});
        assert_eq!(check(ok.clone(), &engine).await.unwrap(), ok);
        // What the decode reads is the value checked: a duplicated member is one value.
        let raw = Bytes::from_static(br#"{"remote_host":"10.0.0.5","remote_host":"6.6.6.6"}"#);
        assert!(checked(Ok(raw), &engine).await.is_err());
        let raw = Bytes::from_static(br#"{"remote_host":"6.6.6.6","remote_host":"10.0.0.5"}"#);
        let out = checked(Ok(raw), &engine).await.unwrap();
        assert_eq!(&out[..], br#"{"remote_host":"10.0.0.5"}"#);
    }

    #[tokio::test]
    async fn the_public_reason_holds_no_value() {
        let engine = prefill("http://10.0.0.5:8000", &[]);
        let e = check(
            json!({"remote_host": "6.6.6.6", "remote_port": 22}),
            &engine,
        )
        .await
        .unwrap_err();
        assert!(
            e.to_string().contains("6.6.6.6"),
            "the operator's log names it: {e}"
        );
        let public = crate::proxy::exposure::Exposure::default().error(&e);
        assert!(
            !public.contains("6.6.6.6") && !public.contains("10.0.0.5"),
            "{public}"
        );
        assert_eq!(e.status(), http::StatusCode::BAD_GATEWAY);
    }
}
