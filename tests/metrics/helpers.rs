//! What the metrics tests share: the admin page scraped, and samples read from it.

use http::StatusCode;
use rankgate::app::Router;

use crate::common::*;

pub async fn scrape(r: &Router) -> String {
    let reply = get(r.admin_addr, "/metrics").await;
    assert_eq!(reply.status, StatusCode::OK);
    let ct = reply.headers["content-type"].to_str().unwrap();
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    String::from_utf8(reply.body.to_vec()).unwrap()
}

/// The value of the one sample named exactly `series` (name and labels), if present.
pub fn sample(page: &str, series: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// The sum of every sample of `name` whose labels include all of `labels`.
pub fn sum(page: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let want: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    page.lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{')))
        .filter(|l| want.iter().all(|w| l.contains(w.as_str())))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
