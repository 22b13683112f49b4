//! The engines' prefix-cache counters, read from their `/metrics` before and after a run: vLLM's
//! `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total`, summed over ranks (and
//! over engines), so the difference is what the run's prompts found cached.

use std::time::Duration;

use http_body_util::{BodyExt, Full};

const QUERIES: &str = "vllm:prefix_cache_queries_total";
const HITS: &str = "vllm:prefix_cache_hits_total";

/// (queries, hits) summed over every series of one scrape; series of other names are ignored.
pub fn prefix_counters(metrics: &str) -> (u64, u64) {
    let (mut q, mut h) = (0.0, 0.0);
    for line in metrics.lines() {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let name = series.split('{').next().unwrap_or(series);
        let Ok(v) = value.parse::<f64>() else {
            continue;
        };
        match name {
            QUERIES => q += v,
            HITS => h += v,
            _ => {}
        }
    }
    (q.max(0.0) as u64, h.max(0.0) as u64)
}

/// Scrapes every engine base URL's `/metrics` and sums their counters; an engine that does not
/// answer, or answers without a 200, is an error naming it.
pub async fn scrape(urls: &[String]) -> Result<(u64, u64), String> {
    let client = rankgate::http::client(Duration::from_secs(2));
    let (mut q, mut h) = (0, 0);
    for url in urls {
        let uri: http::Uri = format!("{}/metrics", url.trim_end_matches('/'))
            .parse()
            .map_err(|e| format!("bad engine url {url:?}: {e}"))?;
        let req = http::Request::get(uri)
            .body(Full::new(bytes::Bytes::new()))
            .map_err(|e| format!("{url}: {e}"))?;
        let resp = tokio::time::timeout(Duration::from_secs(5), client.request(req))
            .await
            .map_err(|_| format!("{url}/metrics: no answer within 5 s"))?
            .map_err(|e| format!("{url}/metrics: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("{url}/metrics: status {}", resp.status()));
        }
        let body = tokio::time::timeout(Duration::from_secs(5), resp.into_body().collect())
            .await
            .map_err(|_| format!("{url}/metrics: body not read within 5 s"))?
            .map_err(|e| format!("{url}/metrics: {e}"))?
            .to_bytes();
        let (a, b) = prefix_counters(&String::from_utf8_lossy(&body));
        q += a;
        h += b;
    }
    Ok((q, h))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_the_two_counters_over_ranks() {
        let fixture =
            include_str!("../../../../tests/fixtures/vllm-0.32-dp2-metrics-under-load.txt");
        assert_eq!(prefix_counters(fixture), (911, 0));
        let text = "# HELP x\nvllm:prefix_cache_hits_total{engine=\"0\"} 32.0\nvllm:prefix_cache_hits_total{engine=\"1\"} 16.0\nvllm:prefix_cache_queries_total{engine=\"1\"} 100.0\nvllm:external_prefix_cache_hits_total{engine=\"0\"} 999.0\n";
        assert_eq!(prefix_counters(text), (100, 48));
    }
}
