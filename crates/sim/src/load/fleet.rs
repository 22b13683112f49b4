//! Every rank of the fleet a run goes through, read from the router's admin listener
//! (`GET /workers`), so that the report lists each rank, those that served nothing included:
//! the rank a user looks for (dark, full, ejected) is the one no answer names.

use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};

/// Longest wait for `/workers`, connection to last byte.
const TIMEOUT: Duration = Duration::from_secs(5);
/// Largest `/workers` read (a large fleet's is a few MB).
const MAX_BODY: usize = 32 * 1024 * 1024;

/// The ids of every rank of the fleet behind the admin listener at `admin` (a base URL), in
/// its order; `token` is the admin token when the router has one. An admin that does not
/// answer, refuses, or answers something that is not a list of workers is an error naming it.
pub async fn ranks(admin: &str, token: Option<&str>) -> Result<Vec<String>, String> {
    let url = format!("{}/workers", admin.trim_end_matches('/'));
    let uri: http::Uri = (url.parse()).map_err(|e| format!("admin URL {admin:?}: {e}"))?;
    let mut req = http::Request::get(uri);
    if let Some(t) = token {
        req = req.header(http::header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let req = (req.body(Full::new(bytes::Bytes::new()))).map_err(|e| format!("{url}: {e}"))?;
    let client = rankgate::http::client(Duration::from_secs(2));
    let read = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("{url}: status {}", resp.status()));
        }
        let body = Limited::new(resp.into_body(), MAX_BODY).collect().await;
        Ok(body.map_err(|e| format!("{url}: {e}"))?.to_bytes())
    };
    let body = tokio::time::timeout(TIMEOUT, read)
        .await
        .map_err(|_| format!("{url}: no whole answer within {} s", TIMEOUT.as_secs()))??;
    ids(&body).map_err(|e| format!("{url}: {e}"))
}

/// The `id` of each worker of a `/workers` document.
fn ids(body: &[u8]) -> Result<Vec<String>, String> {
    #[derive(serde::Deserialize)]
    struct Worker {
        id: String,
    }
    let workers: Vec<Worker> = serde_json::from_slice(body)
        .map_err(|e| format!("not the admin's JSON list of workers: {e}"))?;
    Ok(workers.into_iter().map(|w| w.id).collect())
}

#[cfg(test)]
mod tests {
    use super::ids;

    #[test]
    fn reads_each_workers_id_in_order() {
        let doc = br#"[{"id":"http://a:1@0","kv_usage":0.1},{"id":"http://a:1@1"}]"#;
        assert_eq!(ids(doc).unwrap(), ["http://a:1@0", "http://a:1@1"]);
        let err = ids(b"<html>").unwrap_err();
        assert!(
            err.contains("not the admin's JSON list of workers"),
            "{err}"
        );
    }
}
