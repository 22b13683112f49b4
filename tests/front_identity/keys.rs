//! Client API keys: a key file gates every path, keys come from the environment and the client's
//! header reaches the engine, and unreadable key sources stop the start and say where.

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use rankgate_sim::sim::SimFlavor as Flavor;

use crate::common::*;
use crate::helpers::*;

#[tokio::test]
async fn a_key_file_gates_every_path() {
    let keys = KeyFile::new("# issued to the web team\n\nsk-test-right\n");
    let e = engine(sim(Flavor::Vllm, 1, 0)).await;
    let r = router(
        &format!("{}\n{FAST}", keys.toml()),
        &[engine_toml(&e.url(), "vllm", 1, 0)],
    )
    .await;
    wait_state(&r, &[0], "available").await;

    assert_unauthorized(&send(chat_with(r.addr, &[])).await);
    assert_unauthorized(
        &send(chat_with(
            r.addr,
            &[("authorization", "Bearer sk-test-wrong")],
        ))
        .await,
    );
    assert_unauthorized(
        &send(chat_with(
            r.addr,
            &[("authorization", "Basic c2stdGVzdA==")],
        ))
        .await,
    );
    // No key, no route table: an unknown path is a 401 like any other.
    assert_unauthorized(&get(r.addr, "/v2/secret-admin").await);

    let ok = send(chat_with(
        r.addr,
        &[("authorization", "Bearer sk-test-right")],
    ))
    .await;
    assert_eq!(ok.status, 200, "{}", String::from_utf8_lossy(&ok.body));
    let with_key = Request::get(format!("http://{}/v2/nothing", r.addr))
        .header("authorization", "Bearer sk-test-right")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(send(with_key).await.status, 404);
}

#[tokio::test]
async fn keys_from_the_environment_and_the_client_header_reaches_the_engine() {
    let var = unique("keys").to_uppercase().replace('-', "_");
    // Set before the router starts, which reads it once; nothing else uses this name.
    std::env::set_var(&var, " sk-env-one , ,sk-env-two");
    let (e, r) = header_fleet(&format!("api_keys_env = \"{var}\"")).await;

    assert_unauthorized(&send(chat_with(r.addr, &[])).await);
    let ok = send(chat_with(r.addr, &[("authorization", "Bearer sk-env-two")])).await;
    assert_eq!(ok.status, 200, "{}", String::from_utf8_lossy(&ok.body));
    // The client's key is not rankgate's to drop: the engine gets the header as sent.
    assert_eq!(e.last()["authorization"], "Bearer sk-env-two");
    std::env::remove_var(&var);
}

#[tokio::test]
async fn unreadable_key_sources_stop_the_start_and_say_where() {
    let text = |server: &str| {
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n{server}\n{}",
            engine_toml("http://127.0.0.1:1", "vllm", 1, 0)
        )
    };
    let start = |t: String| async move {
        let cfg = rankgate::config::Config::from_str(&t).unwrap();
        match rankgate::app::Router::start(cfg).await {
            Ok(_) => panic!("started without its keys"),
            Err(e) => e.to_string(),
        }
    };
    let var = unique("unset").to_uppercase().replace('-', "_");
    let e = start(text(&format!("api_keys_env = \"{var}\""))).await;
    assert!(e.contains(&var) && e.contains("not set"), "{e}");

    let missing = std::env::temp_dir().join(unique("no-such-keys"));
    let e = start(text(&format!(
        "api_keys_file = {:?}",
        missing.display().to_string()
    )))
    .await;
    assert!(e.contains(&missing.display().to_string()), "{e}");

    let empty = KeyFile::new("# nothing yet\n\n");
    let e = start(text(&empty.toml())).await;
    assert!(e.contains("no key"), "{e}");
}
