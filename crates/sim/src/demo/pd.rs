//! The demo's last part: prefill/decode disaggregation. A simulated vLLM prefill server and a
//! decode server (two DP ranks each, prefill rank @0 and decode rank @1 starting 90% full with
//! someone else's work) behind rankgate; a handful of chat requests, one at a time; for each, the
//! prefill rank and the decode rank its two legs went to (as the engines saw them, by the request
//! id both legs carry) and the prompt tokens the decode rank took from the prefill server instead
//! of computing them (its `external_kv_transfer` counter).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use serde_json::{json, Value};

use crate::sim::{PdRole, SimConfig, SimEngine, DEFAULT_MODEL};
use rankgate::app::Router;
use rankgate::config::Config;

/// How many requests the part sends, one after the other.
const REQUESTS: usize = 6;
/// Each request's bound, end to end.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest answer read.
const MAX_ANSWER: usize = 1 << 20;

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

async fn side(role: PdRole, preload: Vec<f64>) -> Result<SimEngine, String> {
    let cfg = SimConfig {
        dp_size: 2,
        role: Some(role),
        preload,
        ..SimConfig::default()
    };
    (SimEngine::start(loopback(), cfg).await)
        .map_err(|e| format!("starting a {role:?} server: {e}"))
}

/// One request's two legs, as the engines saw them.
struct Legs {
    prefill_rank: Option<u32>,
    decode_rank: Option<u32>,
    prompt_tokens: u64,
    /// Prompt tokens whose KV the decode rank pulled from the prefill server for this request.
    pulled: u64,
}

/// Runs the part and prints what each request's legs did.
pub async fn run() -> Result<(), String> {
    println!(
        "\nPrefill/decode disaggregation: a simulated vLLM prefill server and a decode server, 2 DP ranks each \
         (prefill @0 and decode @1 start 90% full), {REQUESTS} chat requests through rankgate, one at a time:\n"
    );
    let legs = legs().await?;
    println!("| request | prefill rank | decode rank | prompt tokens | prompt tokens pulled by the decode rank (external_kv_transfer) |");
    println!("|---|---|---|---|---|");
    let rank = |r: Option<u32>| r.map_or("-".into(), |r| format!("@{r}"));
    for (id, l) in &legs {
        println!(
            "| {id} | {} | {} | {} | {} |",
            rank(l.prefill_rank),
            rank(l.decode_rank),
            l.prompt_tokens,
            l.pulled
        );
    }
    println!("(each request's prefill leg asked a prefill rank for one token and where its KV is; its decode leg, the client's answer, pulled that KV and skipped the prefill; each leg's rank chosen by its own side's load)");
    Ok(())
}

/// Starts the pair and the router, sends the requests, and returns each one's legs.
async fn legs() -> Result<Vec<(String, Legs)>, String> {
    let p = side(PdRole::Prefill, vec![0.9, 0.0]).await?;
    let d = side(PdRole::Decode, vec![0.0, 0.9]).await?;
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n\
         [telemetry]\ninterval = \"100ms\"\nstale_after = \"1s\"\n\
         [[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\ndp_size = 2\nrole = \"prefill\"\n\
         [[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\ndp_size = 2\nrole = \"decode\"\n",
        p.url(),
        d.url()
    );
    let cfg = Config::from_str(&toml).map_err(|e| format!("router config: {e}"))?;
    let router = Router::start(cfg).await.map_err(|e| e.to_string())?;
    // Bounded wait for every rank's first telemetry, so the first pick already knows the loads.
    for _ in 0..250 {
        let snapshot = router.table.snapshot.load();
        if snapshot.ranks.iter().all(|r| r.reachable) && snapshot.ranks.len() == 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let client = rankgate::http::client::<Full<Bytes>>(Duration::from_secs(5));
    let mut out = Vec::new();
    let mut failed = None;
    for i in 0..REQUESTS {
        let id = format!("demo-pd-{i}");
        match one(&client, router.addr, &id, &p, &d).await {
            Ok(l) => out.push((id, l)),
            Err(e) => {
                failed = Some(format!("{id}: {e}"));
                break;
            }
        }
    }
    router.shutdown().await;
    p.shutdown().await;
    d.shutdown().await;
    failed.map_or(Ok(out), Err)
}

/// Sends one request and reads back where its legs went.
async fn one(
    client: &rankgate::http::HttpClient<Full<Bytes>>,
    router: SocketAddr,
    id: &str,
    p: &SimEngine,
    d: &SimEngine,
) -> Result<Legs, String> {
    let before = d.pd_counts();
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(24);
    let body = json!({"model": DEFAULT_MODEL, "max_tokens": 16,
        "messages": [{"role": "user", "content": prompt}]});
    let req = http::Request::post(format!("http://{router}/v1/chat/completions"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .header("x-request-id", id)
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let exchange = async {
        let resp = client.request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        let bytes = (Limited::new(resp.into_body(), MAX_ANSWER).collect().await)
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok::<_, String>((status, bytes))
    };
    let (status, bytes) = tokio::time::timeout(REQUEST_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("no answer within {REQUEST_TIMEOUT:?}"))??;
    if !status.is_success() {
        return Err(format!("{status}: {}", String::from_utf8_lossy(&bytes)));
    }
    let answer: Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    let seen = |e: &SimEngine| {
        (e.seen().iter().rev())
            .find(|s| s.request_id.as_deref() == Some(id))
            .map(|s| s.rank)
    };
    let decode_rank = seen(d);
    let pulled = (d.pd_counts().iter().zip(&before))
        .map(|(a, b)| a.external_kv_transfer - b.external_kv_transfer)
        .sum();
    Ok(Legs {
        prefill_rank: seen(p),
        decode_rank,
        prompt_tokens: answer["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        pulled,
    })
}

#[cfg(test)]
mod tests {
    /// Every leg avoids the full rank of its side, and each decode pulled its whole prompt.
    #[tokio::test]
    async fn each_leg_goes_to_the_free_rank_of_its_side() {
        let legs = super::legs().await.unwrap();
        assert_eq!(legs.len(), super::REQUESTS);
        for (id, l) in legs {
            assert_eq!((l.prefill_rank, l.decode_rank), (Some(1), Some(0)), "{id}");
            assert!(
                l.prompt_tokens > 200 && l.pulled == l.prompt_tokens,
                "{id}: {} {}",
                l.prompt_tokens,
                l.pulled
            );
        }
    }
}
