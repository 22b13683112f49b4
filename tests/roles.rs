//! What an operator sees of prefill and decode servers, over real sockets: each rank's and
//! engine's role on the admin listener (`/workers`, `/engines`), set in the config or through
//! `POST /engines`, an SGLang prefill server's bootstrap port, and `rankgate check` (and
//! `check --probe` against running simulated engines) listing roles and warning of a model
//! whose prefill or decode side is missing. The simulated engines need no role for this: the
//! role is the router's view of them.

mod common;

use std::path::PathBuf;
use std::process::Output;

use common::admin::*;
use common::*;
use http::{Method, StatusCode};
use rankgate_sim::sim::SimFlavor;
use serde_json::{json, Value};

/// One `[[engines]]` table of its own DP deployment (no `start_rank`), with more `keys`.
fn entry(url: &str, flavor: &str, dp_size: u32, keys: &str) -> String {
    format!("[[engines]]\nurl = \"{url}\"\nflavor = \"{flavor}\"\ndp_size = {dp_size}\n{keys}\n")
}

/// The rows of `/engines` by URL.
fn engine_row<'a>(engines: &'a Value, url: &str) -> &'a Value {
    (engines.as_array().expect("/engines is an array").iter())
        .find(|e| e["url"] == url)
        .unwrap_or_else(|| panic!("{url} not in /engines: {engines}"))
}

fn roles_of(rows: &[Value], url: &str) -> Vec<String> {
    (rows.iter())
        .filter(|w| w["engine"] == url)
        .map(|w| w["role"].as_str().unwrap_or("(none)").to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_and_engines_show_each_ranks_role_and_the_bootstrap_port() {
    let p = engine(sim(SimFlavor::Vllm, 2, 0)).await;
    let d = engine(sim(SimFlavor::Vllm, 2, 0)).await;
    let sp = engine(sim(SimFlavor::Sglang, 1, 0)).await;
    let whole = engine(sim(SimFlavor::Vllm, 1, 0)).await;
    let r = router(
        FAST,
        &[
            entry(&p.url(), "vllm", 2, "role = \"prefill\""),
            entry(&d.url(), "vllm", 2, "role = \"decode\""),
            entry(
                &sp.url(),
                "sglang",
                1,
                "role = \"prefill\"\nbootstrap_port = 9100",
            ),
            entry(&whole.url(), "vllm", 1, ""),
        ],
    )
    .await;
    let rows = wait_state(&r, &[0, 1, 2, 3, 4, 5], "available").await;
    assert_eq!(roles_of(&rows, &p.url()), ["prefill", "prefill"]);
    assert_eq!(roles_of(&rows, &d.url()), ["decode", "decode"]);
    assert_eq!(roles_of(&rows, &sp.url()), ["prefill"]);
    assert_eq!(roles_of(&rows, &whole.url()), ["both"]);

    let engines = get(r.admin_addr, "/engines").await.json();
    let row = |url: &str| engine_row(&engines, url).clone();
    assert_eq!(
        (
            row(&p.url())["role"].clone(),
            row(&p.url())["bootstrap_port"].clone()
        ),
        (json!("prefill"), Value::Null),
        "a vLLM prefill server has no bootstrap port"
    );
    assert_eq!(row(&d.url())["role"], "decode");
    assert_eq!(row(&d.url())["bootstrap_port"], Value::Null);
    assert_eq!(row(&sp.url())["role"], "prefill");
    assert_eq!(row(&sp.url())["bootstrap_port"], 9100);
    assert_eq!(row(&whole.url())["role"], "both");
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_adds_prefill_and_decode_engines_with_their_roles() {
    let whole = engine(sim(SimFlavor::Vllm, 1, 0)).await;
    let p = engine(sim(SimFlavor::Vllm, 1, 0)).await;
    let d = engine(sim(SimFlavor::Vllm, 2, 0)).await;
    let r = router_with(&token_env(), FAST, &[entry(&whole.url(), "vllm", 1, "")]).await;
    for (e, dp_size, role) in [(&p, 1, "prefill"), (&d, 2, "decode")] {
        let body = json!({"url": e.url(), "flavor": "vllm", "dp_size": dp_size, "role": role});
        let reply = admin(&r, Method::POST, "/engines", Some(TOKEN), Some(body)).await;
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
        assert_eq!(reply.json()["added"], json!([e.url()]));
    }
    let engines = admin(&r, Method::GET, "/engines", None, None).await.json();
    assert_eq!(engine_row(&engines, &whole.url())["role"], "both");
    assert_eq!(engine_row(&engines, &p.url())["role"], "prefill");
    assert_eq!(engine_row(&engines, &p.url())["origin"], "admin");
    assert_eq!(engine_row(&engines, &d.url())["role"], "decode");
    let rows = wait_state(&r, &[0, 1, 2, 3], "available").await;
    assert_eq!(roles_of(&rows, &p.url()), ["prefill"]);
    assert_eq!(roles_of(&rows, &d.url()), ["decode", "decode"]);

    // The admin API checks a role as the config file does, naming the key.
    let other = engine(sim(SimFlavor::Vllm, 1, 0)).await;
    for (keys, want) in [
        (
            json!({"role": "prefill", "bootstrap_port": 8998}),
            "POST /engines.bootstrap_port",
        ),
        (json!({"role": "decoder"}), "decoder"),
    ] {
        let mut body = json!({"url": other.url(), "flavor": "vllm", "dp_size": 1});
        body.as_object_mut()
            .unwrap()
            .extend(keys.as_object().unwrap().clone());
        let reply = admin(&r, Method::POST, "/engines", Some(TOKEN), Some(body)).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{:?}", reply.body);
        let message = reply.json()["error"]["message"]
            .as_str()
            .unwrap_or("")
            .to_string();
        assert!(message.contains(want), "{message}");
    }
    let gateway = json!({"url": other.url(), "flavor": "gateway", "role": "decode"});
    let reply = admin(&r, Method::POST, "/engines", Some(TOKEN), Some(gateway)).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{:?}", reply.body);
    let engines = admin(&r, Method::GET, "/engines", None, None).await.json();
    assert_eq!(engines.as_array().map(Vec::len), Some(3), "{engines}");
    r.shutdown().await;
}

fn config_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rankgate-roles-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

fn check(args: &[&str], path: &std::path::Path) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_rankgate"))
        .arg("check")
        .args(args)
        .arg("--config")
        .arg(path)
        .output()
        .expect("run rankgate check")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn engine_entry(url: &str, flavor: &str, keys: &str) -> String {
    entry(url, flavor, 1, keys)
}

#[test]
fn check_lists_each_engines_role_and_warns_of_a_missing_side() {
    let fleet = [
        engine_entry(
            "http://127.0.0.1:18101",
            "vllm",
            "role = \"prefill\"\nmodels = [\"m\", \"n\"]",
        ),
        engine_entry(
            "http://127.0.0.1:18102",
            "vllm",
            "role = \"decode\"\nmodels = [\"m\"]",
        ),
        engine_entry(
            "http://127.0.0.1:18103",
            "sglang",
            "role = \"prefill\"\nmodels = [\"s\"]",
        ),
        engine_entry(
            "http://127.0.0.1:18104",
            "sglang",
            "role = \"decode\"\nmodels = [\"s\"]",
        ),
        engine_entry("http://127.0.0.1:18105", "vllm", ""),
    ]
    .concat();
    let o = check(&[], &config_file("sides", &fleet));
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(o.status.success(), "{err}");
    let line = |url: &str| {
        (out.lines().find(|l| l.starts_with(url)))
            .unwrap_or_else(|| panic!("{url}:\n{out}"))
            .to_string()
    };
    assert!(
        line("http://127.0.0.1:18101@0").ends_with("\trole=prefill"),
        "{out}"
    );
    assert!(
        line("http://127.0.0.1:18102@0").ends_with("\trole=decode"),
        "{out}"
    );
    assert!(
        line("http://127.0.0.1:18103@0").ends_with("\trole=prefill,bootstrap_port=8998"),
        "{out}"
    );
    assert!(
        line("http://127.0.0.1:18105@0").ends_with("\trole=both"),
        "{out}"
    );
    // Model n has a prefill server and no decode server: a warning names it and its side.
    assert!(
        err.contains(
            "warning: model `n` has prefill servers (engines[0]) and no decode server lists it"
        ),
        "{err}"
    );
    assert!(
        !err.contains("model `m`") && !err.contains("model `s`"),
        "{err}"
    );
    assert!(
        out.contains(
            "note: model `m` is served disaggregated: prefill engines[0], decode engines[1]"
        ),
        "{out}"
    );

    // A fleet with decode servers only: the whole prefill side is missing.
    let decode_only = engine_entry("http://127.0.0.1:18102", "vllm", "role = \"decode\"");
    let o = check(&[], &config_file("decode-only", &decode_only));
    assert!(o.status.success(), "{}", text(&o.stderr));
    let err = text(&o.stderr);
    assert!(
        err.contains("warning: the fleet has decode servers (engines[0]) and no prefill server"),
        "{err}"
    );

    // A discovery entry shows the role its engines get.
    let dns = "[[discovery]]\nkind = \"dns\"\nname = \"localhost\"\nport = 8000\nflavor = \"vllm\"\ndp_size = 1\nrole = \"decode\"\n";
    let o = check(&[], &config_file("discovery", dns));
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(
        out.lines()
            .any(|l| l.starts_with("discovery[0]\t") && l.ends_with("\trole=decode")),
        "{out}"
    );
}

/// `check --probe` against running engines whose models the config does not fix: each probe
/// line says the role, and a model the prefill server serves and no decode server does is
/// warned of once the engines have said what they serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_probe_shows_roles_and_reads_the_models_the_sides_serve() {
    // A prefill server as `--probe` asks one to be: its one-token prefill returns
    // kv_transfer_params.
    let p = engine(rankgate_sim::sim::SimConfig {
        role: Some(rankgate_sim::sim::PdRole::Prefill),
        ..serving(&["shared", "only-prefill"], 1, 0)
    })
    .await;
    let d = engine(serving(&["shared"], 1, 0)).await;
    let fleet = [
        engine_entry(&p.url(), "vllm", "role = \"prefill\""),
        engine_entry(&d.url(), "vllm", "role = \"decode\""),
    ]
    .concat();
    let path = config_file("probe", &fleet);
    // Without the engines' answers, that is left to each request.
    let plain = check(&[], &path);
    assert!(plain.status.success(), "{}", text(&plain.stderr));
    assert!(
        !text(&plain.stderr).contains("only-prefill"),
        "{}",
        text(&plain.stderr)
    );
    assert!(
        text(&plain.stdout).contains("decided per request"),
        "{}",
        text(&plain.stdout)
    );

    let o = tokio::task::spawn_blocking(move || check(&["--probe"], &path))
        .await
        .unwrap();
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(o.status.success(), "{out}\n{err}");
    let probe = |url: &str| {
        let after = out.split_once("probe:\n").map_or("", |(_, a)| a);
        (after.lines().find(|l| l.starts_with(&format!("{url}\t"))))
            .unwrap_or_else(|| panic!("{url}:\n{out}"))
            .to_string()
    };
    assert!(probe(&p.url()).contains("\trole=prefill\t"), "{out}");
    assert!(probe(&d.url()).contains("\trole=decode\t"), "{out}");
    assert!(
        err.contains("warning: model `only-prefill` has prefill servers (engines[0]) and no decode server lists it"),
        "{err}"
    );
    assert!(!err.contains("model `shared`"), "{err}");
}
