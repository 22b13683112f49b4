//! CORS: preflights are answered before the key check, the engine's own CORS answer does not widen
//! the list, `*` allows any origin, and without CORS config OPTIONS goes down the stack.

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use rankgate_sim::sim::SimFlavor as Flavor;

use crate::common::*;
use crate::helpers::*;

fn preflight(addr: std::net::SocketAddr, origin: &str) -> Request<Full<Bytes>> {
    Request::builder()
        .method(Method::OPTIONS)
        .uri(format!("http://{addr}/v1/chat/completions"))
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "authorization, content-type",
        )
        .body(Full::new(Bytes::new()))
        .unwrap()
}

const APP: &str = "https://app.example.com";

#[tokio::test]
async fn cors_preflights_are_answered_before_the_key_check() {
    let keys = KeyFile::new("sk-cors\n");
    let e = engine(sim(Flavor::Vllm, 1, 0)).await;
    let r = router(
        &format!(
            "{}\ncors_allow_origins = [\"{APP}\", \"http://localhost:3000\"]\n{FAST}",
            keys.toml()
        ),
        &[engine_toml(&e.url(), "vllm", 1, 0)],
    )
    .await;
    wait_state(&r, &[0], "available").await;

    let ok = send(preflight(r.addr, APP)).await;
    assert_eq!(ok.status, StatusCode::NO_CONTENT);
    let h = &ok.headers;
    assert_eq!(h["access-control-allow-origin"], APP);
    assert_eq!(h["access-control-allow-methods"], "GET, POST, OPTIONS");
    assert_eq!(
        h["access-control-allow-headers"],
        "authorization, content-type"
    );
    assert_eq!(h["access-control-max-age"], "600");
    assert_eq!(h["vary"], "origin");
    assert_eq!(request_id(&ok).len(), 32);

    let foreign = send(preflight(r.addr, "https://evil.example")).await;
    assert_eq!(foreign.status, StatusCode::FORBIDDEN);
    let v = foreign.json();
    assert_eq!(v["error"]["code"], 403);
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("https://evil.example")),
        "{v}"
    );
    assert!(foreign.headers.get("access-control-allow-origin").is_none());

    // The page can read rankgate's refusal, and the answer's ids once it sends its key.
    let refused = send(chat_with(r.addr, &[("origin", APP)])).await;
    assert_unauthorized(&refused);
    assert_eq!(refused.headers["access-control-allow-origin"], APP);
    let served = send(chat_with(
        r.addr,
        &[("origin", APP), ("authorization", "Bearer sk-cors")],
    ))
    .await;
    assert_eq!(served.status, 200);
    assert_eq!(served.headers["access-control-allow-origin"], APP);
    assert_eq!(
        served.headers["access-control-expose-headers"],
        "x-request-id, x-rankgate-worker"
    );
    // Another origin's actual request is served (the browser withholds it from the page).
    let other = send(chat_with(
        r.addr,
        &[
            ("origin", "https://evil.example"),
            ("authorization", "Bearer sk-cors"),
        ],
    ))
    .await;
    assert_eq!(other.status, 200);
    assert!(other.headers.get("access-control-allow-origin").is_none());
}

#[tokio::test]
async fn the_engines_own_cors_answer_does_not_widen_the_list() {
    let (_e, r) = header_fleet(&format!("cors_allow_origins = [\"{APP}\"]")).await;
    let other = send(chat_with(r.addr, &[("origin", "https://evil.example")])).await;
    assert_eq!(other.status, 200);
    assert!(
        other.headers.get("access-control-allow-origin").is_none(),
        "{:?}",
        other.headers
    );
    let ours = send(chat_with(r.addr, &[("origin", APP)])).await;
    assert_eq!(
        ours.headers
            .get_all("access-control-allow-origin")
            .iter()
            .collect::<Vec<_>>(),
        [APP]
    );
}

#[tokio::test]
async fn cors_star_allows_any_origin() {
    let e = engine(sim(Flavor::Vllm, 1, 0)).await;
    let r = router(
        &format!("cors_allow_origins = [\"*\"]\n{FAST}"),
        &[engine_toml(&e.url(), "vllm", 1, 0)],
    )
    .await;
    wait_state(&r, &[0], "available").await;
    let ok = send(preflight(r.addr, "https://anywhere.test")).await;
    assert_eq!(ok.status, StatusCode::NO_CONTENT);
    assert_eq!(ok.headers["access-control-allow-origin"], "*");
    assert!(ok.headers.get("vary").is_none());
    let served = send(chat_with(r.addr, &[("origin", "https://anywhere.test")])).await;
    assert_eq!(served.status, 200);
    assert_eq!(served.headers["access-control-allow-origin"], "*");
}

#[tokio::test]
async fn without_cors_config_options_goes_down_the_stack() {
    let (_e, r) = fleet(sim(Flavor::Vllm, 1, 0)).await;
    let reply = send(preflight(r.addr, APP)).await;
    assert_eq!(reply.status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(reply.headers.get("access-control-allow-origin").is_none());
    let served = {
        wait_state(&r, &[0], "available").await;
        send(chat_with(r.addr, &[("origin", APP)])).await
    };
    assert_eq!(served.status, 200);
    assert!(served.headers.get("access-control-allow-origin").is_none());
    assert!(served.headers.get("vary").is_none());
}
