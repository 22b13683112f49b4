//! What the front door identity tests share: a router in front of an engine that records headers,
//! unique names, key files, chat requests with headers, a reply's request id, and the 401 a
//! request without a good key gets.

use std::path::PathBuf;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;

use crate::common::headers::HeaderEngine;
use crate::common::*;

/// A router with `server_keys` (more `[server]` keys) in front of the header-recording engine,
/// its two ranks showing fresh telemetry.
pub async fn header_fleet(server_keys: &str) -> (HeaderEngine, rankgate::app::Router) {
    let e = HeaderEngine::start().await;
    let r = router(
        &format!("{server_keys}\n{FAST}"),
        &[format!(
            "[[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\ndp_size = 2\ntelemetry = [\"prometheus\"]\n",
            e.url
        )],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    (e, r)
}

/// A name no other test (or run) uses.
pub fn unique(what: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("rankgate-{what}-{}-{nanos}", std::process::id())
}

/// A key file in the temp directory, removed when dropped.
pub struct KeyFile(pub PathBuf);

impl KeyFile {
    pub fn new(text: &str) -> KeyFile {
        let path = std::env::temp_dir().join(unique("keys"));
        std::fs::write(&path, text).unwrap();
        KeyFile(path)
    }

    /// The `[server]` line that points at it.
    pub fn toml(&self) -> String {
        format!("api_keys_file = {:?}", self.0.display().to_string())
    }
}

impl Drop for KeyFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

pub fn chat_with(addr: std::net::SocketAddr, headers: &[(&str, &str)]) -> Request<Full<Bytes>> {
    let mut b = post(addr, "/v1/chat/completions");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(Bytes::from(chat_body(4, false)))).unwrap()
}

pub fn request_id(reply: &Reply) -> String {
    reply
        .headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("no x-request-id on the answer: {:?}", reply.headers))
        .to_string()
}

pub fn assert_unauthorized(reply: &Reply) {
    assert_eq!(
        reply.status,
        401,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(reply.headers["www-authenticate"], "Bearer");
    let v = reply.json();
    assert_eq!(v["error"]["type"], "AuthenticationError");
    assert_eq!(v["error"]["code"], 401);
    // Refusals come from rankgate, with an id a client can quote.
    assert_eq!(request_id(reply).len(), 32);
}
