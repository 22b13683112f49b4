//! Helpers for tests of the admin API and reloads: an admin token in a fresh environment
//! variable, admin requests, and config files that tests rewrite.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::Full;
use rankgate::app::Router;
use serde_json::Value;

use super::{send, Reply};

pub const TOKEN: &str = "admin-secret-token";

/// A fresh environment variable holding [`TOKEN`], and the `[server]` key naming it.
pub fn token_env() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let var = format!(
        "RANKGATE_TEST_ADMIN_TOKEN_{}_{}",
        std::process::id(),
        N.fetch_add(1, Relaxed)
    );
    std::env::set_var(&var, TOKEN);
    format!("admin_token_env = \"{var}\"\n")
}

/// An admin request, with `token` as its bearer token if given.
pub async fn admin(
    r: &Router,
    method: Method,
    path: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> Reply {
    let mut req = Request::builder()
        .method(method)
        .uri(format!("http://{}{path}", r.admin_addr));
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let body = body.map_or(Bytes::new(), |b| Bytes::from(b.to_string()));
    send(req.body(Full::new(body)).unwrap()).await
}

/// A config file in the temp directory, removed when dropped.
pub struct TempConfig(pub PathBuf);

impl TempConfig {
    pub fn new(text: &str) -> TempConfig {
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "rankgate-config-{}-{}.toml",
            std::process::id(),
            N.fetch_add(1, Relaxed)
        ));
        std::fs::write(&path, text).unwrap();
        TempConfig(path)
    }

    pub fn write(&self, text: &str) {
        std::fs::write(&self.0, text).unwrap();
    }
}

impl Drop for TempConfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
