//! Gray failures: a rank whose requests hang (its `/health` and `/metrics` answer, its requests
//! never get a first byte) beside a healthy one, clients giving up after 2 s, 5 requests a
//! second. The hung rank is judged by its requests' wait against the fleet's recent time to
//! first byte, ejected within seconds, and `/workers`, `top` and `/metrics` say why.
//!
//! CI runs 40 requests over 8 s; `RANKGATE_GRAY_FULL=1` runs the acceptance's 100 over 20 s
//! (`bench/gray-failure.sh` does, and prints the figures).

use std::time::Duration;

use tokio::time::{sleep_until, timeout, Instant};

use super::helpers::*;
use crate::common::*;

/// Clients give up after this.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);
/// One request every this.
const PACE: Duration = Duration::from_millis(200);
/// Requests reaching the hung rank are counted from here on.
const SETTLED: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_rank_beside_a_healthy_one_is_ejected_and_shown() {
    let total: u32 = if std::env::var_os("RANKGATE_GRAY_FULL").is_some() {
        100
    } else {
        40
    };
    let (hung, good) = (engine(vllm(1, 0)).await, engine(vllm(1, 1)).await);
    let r = router(FAST, &[toml_of(&hung, 1, 0), toml_of(&good, 1, 1)]).await;
    wait_state(&r, &[0, 1], "available").await;
    hung.set_hang_requests(true);
    let hung_id = format!("{}@0", hung.url());

    let started = Instant::now();
    let mut at_settled = None;
    let mut clients = Vec::new();
    for i in 0..total {
        let at = started + PACE * i;
        sleep_until(at).await;
        if at_settled.is_none() && at >= started + SETTLED {
            at_settled = Some(hung.requests_received());
        }
        let addr = r.addr;
        clients.push(tokio::spawn(async move {
            timeout(CLIENT_TIMEOUT, chat(addr, 4)).await.ok()
        }));
    }
    let mut answered = 0;
    let mut gave_up = 0;
    for c in clients {
        match c.await.expect("client task") {
            Some(reply) => {
                assert_eq!(
                    reply.status,
                    200,
                    "{}",
                    String::from_utf8_lossy(&reply.body)
                );
                assert!(is_on(&reply.worker(), &good), "{}", reply.worker());
                answered += 1;
            }
            None => gave_up += 1,
        }
    }
    let took = started.elapsed();
    let on_hung = hung.requests_received();
    let late = on_hung - at_settled.expect("the run lasts past SETTLED");
    println!(
        "gray failure: {total} requests over {took:.1?}, clients giving up after \
         {CLIENT_TIMEOUT:?}: {on_hung} reached the hung rank ({late} after the first \
         {SETTLED:?}), {answered} answered by the healthy rank, {gave_up} abandoned"
    );
    assert!(
        late <= 3,
        "{late} requests reached the hung rank after {SETTLED:?}"
    );
    assert_eq!(answered + gave_up, total);

    // /workers: why. The rank is ejected after `eject_after` hung requests in a row; when its
    // first few failures' penalty alone kept the traffic off it (as often as not with this few
    // requests), it shows its run of hung failures instead.
    let rows = workers(&r).await;
    let row = rows_of(&rows, &hung)[0].clone();
    let ejected = row["reason_kind"] == "ejected";
    if ejected {
        assert!(
            reason(&row).contains("consecutive requests with no first byte long past the fleet's"),
            "{row:#}"
        );
    }
    let f = &row["failures"];
    assert_eq!(f["kind"], "hung", "{row:#}");
    assert!(f["hung_requests"].as_u64().unwrap_or(0) >= 1, "{row:#}");
    assert!(
        f["abandoned_before_first_byte"].as_u64().unwrap_or(0) >= 1,
        "{row:#}"
    );
    let run = row["consecutive_failures"].as_u64().unwrap_or(0);
    assert!(run >= if ejected { 5 } else { 1 }, "{row:#}");
    let good_row = rows_of(&rows, &good)[0].clone();
    assert_eq!(good_row["telemetry"], "available", "{good_row:#}");
    assert_eq!(good_row["consecutive_failures"], 0, "{good_row:#}");

    // /metrics: the abandoned and hung requests, the ejection, the bound they were judged by.
    let m = |series: String| {
        let r = &r;
        async move { metric(r, &series).await }
    };
    let abandoned = m(format!(
        "rankgate_requests_abandoned_total{{worker=\"{hung_id}\",reason=\"before_first_byte\"}}"
    ))
    .await;
    assert!(abandoned >= 1.0, "{abandoned}");
    assert!(
        m(format!(
            "rankgate_requests_hung_total{{worker=\"{hung_id}\"}}"
        ))
        .await
            >= 1.0
    );
    assert_eq!(
        m(format!("rankgate_rank_ejected{{worker=\"{hung_id}\"}}")).await,
        if ejected { 1.0 } else { 0.0 }
    );
    assert_eq!(
        m(format!(
            "rankgate_rank_consecutive_failures{{worker=\"{hung_id}\"}}"
        ))
        .await,
        run as f64
    );
    assert!(m("rankgate_first_byte_hung_after_seconds".into()).await >= 1.0);
    assert!(m("rankgate_first_byte_p99_seconds".into()).await > 0.0);

    // top, from the live admin listener: the rank's FAIL cell says hung (and it is shown ejected
    // when it is).
    let doc = get(r.admin_addr, "/workers").await.body;
    let page = String::from_utf8_lossy(&get(r.admin_addr, "/metrics").await.body).into_owned();
    let mut top =
        rankgate_top::State::new(format!("http://{}", r.admin_addr), Duration::from_secs(1));
    top.apply(Instant::now(), &doc, Ok(&page))
        .expect("top reads /workers");
    let shown = (top.rows().iter())
        .find(|row| row.id == hung_id)
        .expect("the hung rank in top")
        .clone();
    if ejected {
        assert_eq!(shown.state(), "ejected");
    }
    let fail = shown.fail_cell().unwrap_or_default();
    assert!(fail.ends_with(" hung"), "{fail}");
}
