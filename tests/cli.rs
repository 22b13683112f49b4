//! The `rankgate` binary: `check` output, config errors (exit 64, key named), `--version`.

use std::path::PathBuf;
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rankgate"))
}

/// Writes `text` to a config file unique to this test.
fn config_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rankgate-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("run rankgate")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn check_lists_one_line_per_virtual_worker() {
    let p = config_file(
        "good",
        "[[engines]]\nurl = \"http://127.0.0.1:18001\"\nflavor = \"vllm\"\ndp_size = 2\n\
         [[engines]]\nurl = \"http://127.0.0.1:18002\"\nflavor = \"sglang\"\ndp_size = 2\nstart_rank = 4\n",
    );
    let o = run(&["check", "--config", p.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4);
    assert!(lines[2].starts_with("http://127.0.0.1:18002@4\t"));
    assert!(lines[2].contains("rank=4") && lines[2].contains("flavor=sglang"));
}

#[test]
fn shipped_example_config_is_valid() {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/rankgate.toml");
    let o = run(&["check", "--config", p]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn config_errors_exit_64_naming_file_and_key() {
    let cases = [
        ("unknown", "[server]\nlisen = \"127.0.0.1:1\"\n", "lisen"),
        ("at", "[[engines]]\nurl = \"http://h:1@2\"\nflavor = \"vllm\"\n", "engines[0].url"),
        ("path", "[[engines]]\nurl = \"http://h:1/v1\"\nflavor = \"vllm\"\n", "engines[0].url"),
        (
            "dup",
            "[[engines]]\nurl = \"http://h:1\"\nflavor = \"vllm\"\n[[engines]]\nurl = \"http://h:1\"\nflavor = \"vllm\"\n",
            "engines[1].url",
        ),
        ("dp", "[[engines]]\nurl = \"http://h:1\"\nflavor = \"vllm\"\ndp_size = 0\n", "engines[0].dp_size"),
        ("stale", "[telemetry]\ninterval = \"1s\"\nstale_after = \"1s\"\n[[engines]]\nurl = \"http://h:1\"\nflavor = \"vllm\"\n", "telemetry.stale_after"),
        ("dur", "[telemetry]\ninterval = \"fast\"\n[[engines]]\nurl = \"http://h:1\"\nflavor = \"vllm\"\n", "interval"),
        ("none", "[routing]\npolicy = \"least_kv\"\n", "engines"),
        (
            "keyfile",
            "[server]\napi_keys_file = \"/nonexistent/rankgate-keys\"\n[[engines]]\nurl = \"http://h:1\"\nflavor = \"vllm\"\n",
            "/nonexistent/rankgate-keys",
        ),
        (
            "enginekey",
            "[[engines]]\nurl = \"http://h:1\"\nflavor = \"vllm\"\napi_key_env = \"RANKGATE_CLI_TEST_UNSET\"\n",
            "engines[0].api_key_env",
        ),
    ];
    for (name, text, key) in cases {
        let p = config_file(name, text);
        for cmd in ["check", "serve"] {
            let o = run(&[cmd, "--config", p.to_str().unwrap()]);
            assert_eq!(o.status.code(), Some(64), "{name}/{cmd}: {}", stderr(&o));
            let e = stderr(&o);
            assert!(e.contains(key), "{name}/{cmd}: key {key} not named in: {e}");
            assert!(
                e.contains(p.to_str().unwrap()),
                "{name}/{cmd}: file not named in: {e}"
            );
        }
    }
    let o = run(&["check", "--config", "/nonexistent/rankgate.toml"]);
    assert_eq!(o.status.code(), Some(64));
    assert!(stderr(&o).contains("/nonexistent/rankgate.toml"));
}

#[test]
fn version_and_help() {
    let o = run(&["--version"]);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains(env!("CARGO_PKG_VERSION")));
    let o = run(&["--help"]);
    assert!(o.status.success());
    let help = String::from_utf8_lossy(&o.stdout);
    let demo = cfg!(feature = "sim").then_some("demo");
    for cmd in ["serve", "check"].into_iter().chain(demo) {
        assert!(help.contains(cmd), "{help}");
    }
}

#[test]
fn check_warns_about_engines_at_one_address() {
    let p = config_file(
        "same-address",
        "[[engines]]\nurl = \"http://localhost:18003\"\nflavor = \"vllm\"\n\
         [[engines]]\nurl = \"http://127.0.0.1:18003\"\nflavor = \"vllm\"\nstart_rank = 1\n",
    );
    let o = run(&["check", "--config", p.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("warning") && err.contains("127.0.0.1:18003"),
        "{err}"
    );
}

#[test]
fn an_invalid_rust_log_is_reported_not_ignored() {
    let cfg = config_file(
        "rust-log.toml",
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[[engines]]\nurl = \"http://127.0.0.1:1\"\nflavor = \"vllm\"\n",
    );
    let out = bin()
        .args(["serve", "--config"])
        .arg(&cfg)
        .env("RUST_LOG", "rankgate=loud")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("\"loud\" in \"rankgate=loud\" is not a level"),
        "{}",
        stderr(&out)
    );
    let out = bin()
        .args(["serve", "--log-format", "xml", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    assert!(
        stderr(&out).contains("use text or json"),
        "{}",
        stderr(&out)
    );
}

/// Without `--config`, `./rankgate.toml` is read where it exists, else the system's file, named
/// in the error when it is missing too.
#[test]
fn the_config_defaults_to_the_local_file_then_the_system_one() {
    let dir = std::env::temp_dir().join(format!("rankgate-cli-default-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("rankgate.toml"),
        "[[engines]]\nurl = \"http://127.0.0.1:18001\"\nflavor = \"vllm\"\ndp_size = 1\n",
    )
    .unwrap();
    let o = bin().arg("check").current_dir(&dir).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("http://127.0.0.1:18001@0"));
    std::fs::remove_file(dir.join("rankgate.toml")).unwrap();
    let o = bin().arg("check").current_dir(&dir).output().unwrap();
    assert_eq!(o.status.code(), Some(64));
    assert!(
        stderr(&o).contains("/etc/rankgate/rankgate.toml"),
        "{}",
        stderr(&o)
    );
}
