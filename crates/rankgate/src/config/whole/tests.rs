use std::time::Duration;

use super::super::duration::parse_duration;
use super::super::engine::{Flavor, Reported, TelemetrySource};
use super::super::polling::{DEFAULT_INTERVAL, DEFAULT_STALE_AFTER};
use super::super::routing::Policy;
use super::super::server::DEFAULT_RESPONSE_TIMEOUT;
use super::*;

#[test]
fn a_duration_without_its_unit_says_how_to_write_it() {
    let e = Config::from_str("[telemetry]\ninterval = 250\n[[engines]]\nurl = \"http://a:1\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("line 2, column 12, key `interval`: a number has no unit")
            && e.contains("\"250ms\""),
        "{e}"
    );
    let e = Config::from_str("[telemetry]\ninterval = true\n[[engines]]\nurl = \"http://a:1\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("such as \"250ms\""), "{e}");
}

#[test]
fn what_the_engine_reports_shapes_it() {
    let c = Config::from_str("[[engines]]\nurl = \"http://a:1\"\n").unwrap();
    let e = &c.engines[0];
    let sglang = Reported {
        flavor: Flavor::Sglang,
        dp_size: Some(4),
        from: "test",
        at_least: false,
    };
    let shaped = e.with_reported(Some(&sglang));
    assert_eq!((shaped.flavor, shaped.dp_size), (Flavor::Sglang, 4));
    // The flavor's own sources: SGLang's /v1/loads first.
    assert!(
        matches!(&shaped.telemetry[0], TelemetrySource::Http { url } if url.ends_with("/v1/loads?include=core"))
    );
    assert_eq!(shaped.mismatch(), None);
    // A configured size loses to the engine's, and says so.
    let c =
        Config::from_str("[[engines]]\nurl = \"http://a:1\"\nflavor = \"sglang\"\ndp_size = 2\n")
            .unwrap();
    let shaped = c.engines[0].with_reported(Some(&sglang));
    assert_eq!(shaped.dp_size, 4);
    assert!(shaped.mismatch().unwrap().contains("configured dp_size 2"));
    // Ranks counted from /metrics labels are "at least": a configured rank without a series
    // yet stays (unavailable for want of telemetry), noted but not dropped.
    let labels = Reported {
        flavor: Flavor::Sglang,
        dp_size: Some(1),
        from: "test",
        at_least: true,
    };
    let shaped = c.engines[0].with_reported(Some(&labels));
    assert_eq!(shaped.dp_size, 2);
    assert!(shaped.mismatch().unwrap().contains("name only 1"));
    let more = Reported {
        dp_size: Some(3),
        ..labels
    };
    assert_eq!(c.engines[0].with_reported(Some(&more)).dp_size, 3);
    // A group member keeps its configured share whatever the deployment's size.
    let c = Config::from_str(
        "[[engines]]\nurl = \"http://a:1\"\nflavor = \"sglang\"\ndp_size = 2\nstart_rank = 2\n",
    )
    .unwrap();
    assert_eq!(c.engines[0].with_reported(Some(&sglang)).ranks(), 2..4);
}

const MIN: &str = "[[engines]]\nurl = \"http://127.0.0.1:18001\"\nflavor = \"vllm\"\ndp_size = 2\n";

fn err(text: &str) -> String {
    Config::from_str(text).unwrap_err().to_string()
}

#[test]
fn a_fleet_beyond_the_worker_cap_is_refused() {
    let text: String = (0..17)
        .map(|i| format!("[[engines]]\nurl = \"http://h{i}:1\"\nflavor = \"vllm\"\ndp_size = 4096\nstart_rank = {}\n", i * 4096))
        .collect();
    let e = err(&text);
    assert!(
        e.contains("engines") && e.contains("69632 workers") && e.contains("65536"),
        "{e}"
    );
}

#[test]
fn minimal_config_gets_defaults() {
    let c = Config::from_str(MIN).unwrap();
    assert_eq!(c.telemetry.interval, DEFAULT_INTERVAL);
    assert_eq!(c.telemetry.stale_after, DEFAULT_STALE_AFTER);
    assert_eq!(c.routing.policy, Policy::LeastKv);
    assert_eq!(c.engines[0].ranks(), 0..2);
    assert_eq!(&*c.engines[0].authority, "127.0.0.1:18001");
}

#[test]
fn durations() {
    assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
    assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
    assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
    assert!(parse_duration("5").is_err());
    assert!(parse_duration("5h").is_err());
    assert!(parse_duration("ms").is_err());
}

#[test]
fn unknown_key_is_named() {
    let e = err(&format!("[server]\nlisen = \"127.0.0.1:1\"\n{MIN}"));
    // Named by where it is: what the file says is never quoted back.
    assert!(
        e.contains("line 2, column 1, key `lisen`: unknown field `lisen`, expected one of"),
        "{e}"
    );
}

#[test]
fn engine_url_rules() {
    let at = err("[[engines]]\nurl = \"http://h:1@3\"\nflavor = \"vllm\"\n");
    assert!(at.contains("engines[0].url") && at.contains('@'), "{at}");
    let path = err("[[engines]]\nurl = \"http://h:1/v1\"\nflavor = \"vllm\"\n");
    assert!(path.contains("path"), "{path}");
    let dup = err(&format!("{MIN}{MIN}"));
    assert!(
        dup.contains("engines[1].url") && dup.contains("duplicate"),
        "{dup}"
    );
    let port = err("[[engines]]\nurl = \"http://h\"\nflavor = \"vllm\"\n");
    assert!(port.contains("port"), "{port}");
}

#[test]
fn resilience_keys_have_defaults_and_bounds() {
    let c = Config::from_str(MIN).unwrap();
    assert_eq!(c.server.response_timeout, DEFAULT_RESPONSE_TIMEOUT);
    assert_eq!(c.routing.max_attempts, 3);
    assert_eq!(c.server.max_in_flight, None);
    let e = err(&format!("[server]\nresponse_timeout = \"1ms\"\n{MIN}"));
    assert!(
        e.contains("server.response_timeout") && e.contains("range"),
        "{e}"
    );
    let e = err(&format!("[routing]\nmax_attempts = 0\n{MIN}"));
    assert!(e.contains("routing.max_attempts"), "{e}");
    let e = err(&format!("[routing]\nretry_budget = 1.5\n{MIN}"));
    assert!(e.contains("routing.retry_budget"), "{e}");
    assert!(
        c.routing.retry_on.is_empty(),
        "an engine's 500 is not retried by default"
    );
    let c500 = Config::from_str(&format!("[routing]\nretry_on = [500, 503]\n{MIN}")).unwrap();
    assert_eq!(c500.routing.retry_on, [500, 503]);
    for bad in ["501", "404", "429"] {
        let e = err(&format!("[routing]\nretry_on = [{bad}]\n{MIN}"));
        assert!(
            e.contains("routing.retry_on") && e.contains(&format!("{bad} cannot be retried")),
            "{e}"
        );
    }
    let e = err(&format!("[routing]\nretry_on = [\"5xx\"]\n{MIN}"));
    assert!(e.contains("retry_on"), "{e}");
    let e = err(&format!("[server]\nmax_in_flight = 0\n{MIN}"));
    assert!(e.contains("server.max_in_flight"), "{e}");
    let e = err(&format!("[server]\nmax_header_bytes = 100\n{MIN}"));
    assert!(e.contains("server.max_header_bytes"), "{e}");
    let e = err(&format!("[server]\nmax_header_bytes = 4294967396\n{MIN}"));
    assert!(e.contains("server.max_header_bytes"), "{e}");
    let e = err(&format!("[routing]\neject_for = \"10m\"\n{MIN}"));
    assert!(e.contains("routing.eject_for"), "{e}");
}

#[test]
fn front_door_access_keys() {
    let c = Config::from_str(&format!(
        "[server]\napi_keys_env = \"RG_KEYS\"\napi_keys_file = \"/etc/rg/keys\"\n\
         cors_allow_origins = [\"https://app.example.com\", \"http://localhost:3000\", \"*\"]\n{MIN}"
    ))
    .unwrap();
    assert_eq!(c.server.api_keys_env.as_deref(), Some("RG_KEYS"));
    assert_eq!(c.server.cors_allow_origins.len(), 3);
    let e = err(&format!("[server]\napi_keys_env = \"\"\n{MIN}"));
    assert!(e.contains("server.api_keys_env"), "{e}");
    let e = err(&format!("[server]\napi_keys_env = \"A=B\"\n{MIN}"));
    assert!(e.contains("server.api_keys_env"), "{e}");
    let e = err(&format!("[server]\napi_keys_file = \"\"\n{MIN}"));
    assert!(e.contains("server.api_keys_file"), "{e}");
    for bad in [
        "app.example.com",
        "https://app.example.com/",
        "https://",
        "https://a b",
    ] {
        let e = err(&format!(
            "[server]\ncors_allow_origins = [\"*\", {bad:?}]\n{MIN}"
        ));
        assert!(e.contains("server.cors_allow_origins[1]"), "{bad}: {e}");
    }
}

#[test]
fn stale_after_must_exceed_interval() {
    let e = err(&format!(
        "[telemetry]\ninterval = \"1s\"\nstale_after = \"500ms\"\n{MIN}"
    ));
    assert!(e.contains("telemetry.stale_after"), "{e}");
}

#[test]
fn https_engines_and_tls_sources() {
    let c = Config::from_str(
        "[[engines]]\nurl = \"https://h:1/\"\ngrpc_url = \"https://h:2\"\nflavor = \"vllm\"\n[[engines]]\nurl = \"http://g:1\"\nflavor = \"sglang\"\ntelemetry = [\"grpcs://g:2\", \"https://g:3/loads\"]\n",
    )
    .unwrap();
    let (tls, clear) = (&c.engines[0], &c.engines[1]);
    assert!(tls.tls() && !clear.tls());
    assert_eq!(&*tls.url, "https://h:1");
    assert_eq!(tls.grpc_origin(), "https://h:2");
    assert_eq!(
        tls.telemetry[0],
        TelemetrySource::Grpc {
            authority: "h:2".into(),
            tls: true
        },
        "GetLoads over TLS, as the engine's gRPC URL says"
    );
    assert_eq!(
        clear.telemetry,
        [
            TelemetrySource::Grpc {
                authority: "g:2".into(),
                tls: true
            },
            TelemetrySource::Http {
                url: "https://g:3/loads".into()
            }
        ]
    );
    let e =
        err("[[engines]]\nurl = \"https://h:1\"\ngrpc_url = \"http://h:2\"\nflavor = \"vllm\"\n");
    assert!(
        e.contains("engines[0].grpc_url") && e.contains("one TLS setting"),
        "{e}"
    );
    let e = err("[[engines]]\nurl = \"ftp://h:1\"\nflavor = \"vllm\"\n");
    assert!(e.contains("http:// or https://"), "{e}");
    let e = err("[engine_tls]\ncert_file = \"c.pem\"\n[[engines]]\nurl = \"http://h:1\"\n");
    assert!(e.contains("engine_tls") && e.contains("key_file"), "{e}");
    let e = err("[server.tls]\ncert_file = \"c.pem\"\nkey_file = \"k.pem\"\nkey = 1\n[[engines]]\nurl = \"http://h:1\"\n");
    assert!(e.contains("unknown field `key`"), "{e}");
}

#[test]
fn telemetry_sources() {
    let sg = Config::from_str("[[engines]]\nurl = \"http://h:1\"\nflavor = \"sglang\"\n").unwrap();
    assert_eq!(
        sg.engines[0].telemetry,
        [
            TelemetrySource::Http {
                url: "http://h:1/v1/loads?include=core".into()
            },
            TelemetrySource::Prometheus
        ]
    );
    let v = Config::from_str(
        "[[engines]]\nurl = \"http://h:1\"\nflavor = \"vllm\"\ntelemetry = [\"grpc://h:2\", \"prometheus\"]\n",
    )
    .unwrap();
    assert_eq!(
        v.engines[0].telemetry[0],
        TelemetrySource::Grpc {
            authority: "h:2".into(),
            tls: false,
        }
    );
    let e = err("[[engines]]\nurl = \"http://h:1\"\nflavor = \"vllm\"\ntelemetry = [\"http\"]\n");
    assert!(
        e.contains("engines[0].telemetry") && e.contains("vLLM"),
        "{e}"
    );
    let e = err(
        "[[engines]]\nurl = \"http://h:1\"\nflavor = \"vllm\"\ntelemetry = [\"carrier-pigeon\"]\n",
    );
    assert!(e.contains("unknown source"), "{e}");
    let e = err("[[engines]]\nurl = \"http://h:1\"\nflavor = \"gateway\"\ndp_size = 2\n");
    assert!(e.contains("engines[0].dp_size"), "{e}");
    let g = Config::from_str("[[engines]]\nurl = \"http://h:1\"\nflavor = \"gateway\"\n").unwrap();
    assert_eq!(
        g.engines[0].telemetry,
        [TelemetrySource::Http {
            url: "http://h:1/loads".into()
        }]
    );
}

#[test]
fn engines_by_http_grpc_or_both() {
    let grpc =
        |extra: &str| format!("[[engines]]\ngrpc_url = \"http://h:9\"\nflavor = \"vllm\"\n{extra}");
    let only = Config::from_str(&grpc("")).unwrap();
    let e = &only.engines[0];
    assert!(!e.http && e.grpc.as_deref() == Some("h:9"));
    assert_eq!(&*e.url, "http://h:9", "the gRPC address is its identity");
    assert_eq!(
        e.telemetry,
        [TelemetrySource::Grpc {
            authority: "h:9".into(),
            tls: false,
        }],
        "polled by GetLoads"
    );
    assert_eq!(e.health_path, None, "no HTTP to probe");
    for bad in ["telemetry = [\"prometheus\"]", "telemetry = [\"http\"]"] {
        let e = err(&grpc(bad));
        assert!(
            e.contains("engines[0].telemetry") && e.contains("grpc_url"),
            "{e}"
        );
    }
    let e = err(&grpc("health_path = \"/health\""));
    assert!(e.contains("engines[0].health_path"), "{e}");
    let both = Config::from_str(&grpc("url = \"http://h:1\"")).unwrap();
    let e = &both.engines[0];
    assert!(e.http && &*e.url == "http://h:1");
    assert_eq!(
        e.telemetry,
        [
            TelemetrySource::Grpc {
                authority: "h:9".into(),
                tls: false,
            },
            TelemetrySource::Prometheus
        ],
        "GetLoads first, Prometheus behind it"
    );
    let e = err("[[engines]]\nflavor = \"vllm\"\n");
    assert!(e.contains("engines[0]") && e.contains("grpc_url"), "{e}");
    let e = err("[[engines]]\ngrpc_url = \"grpc://h:9\"\nflavor = \"vllm\"\n");
    assert!(
        e.contains("engines[0].grpc_url") && e.contains("http://"),
        "{e}"
    );
    let e = err("[[engines]]\ngrpc_url = \"http://h:9\"\nflavor = \"gateway\"\n");
    assert!(e.contains("engines[0].grpc_url"), "{e}");
    let e = err(&format!(
        "{}{}",
        grpc(""),
        grpc("start_rank = 1").replace("h:9\"", "h:9/\"")
    ));
    assert!(e.contains("engines[1]") && e.contains("duplicate"), "{e}");
    let e = err(&format!(
        "[server]\ngrpc_listen = \"127.0.0.1:8080\"\n{}",
        grpc("")
    ));
    assert!(e.contains("server.grpc_listen"), "{e}");
    let e = err(&format!(
        "[server]\ngrpc_listen = \"nowhere\"\n{}",
        grpc("")
    ));
    assert!(e.contains("server.grpc_listen"), "{e}");
}

#[test]
fn bad_flavor_and_policy_are_named() {
    let e = err("[[engines]]\nurl = \"http://h:1\"\nflavor = \"tgi\"\n");
    assert!(
        e.contains("line 3, column 10, key `flavor`: unknown variant `…`, expected one of `vllm`"),
        "{e}"
    );
    let e = err(&format!("[routing]\npolicy = \"fastest\"\n{MIN}"));
    assert!(e.contains("line 2") && e.contains("unknown variant"), "{e}");
}

/// One engine with `keys` after its url and flavor.
fn one(flavor: &str, keys: &str) -> String {
    format!("[[engines]]\nurl = \"http://h:1\"\nflavor = \"{flavor}\"\ndp_size = 1\n{keys}\n")
}

#[test]
fn roles_default_to_both_and_name_the_key_when_wrong() {
    use super::super::engine::{Role, SGLANG_BOOTSTRAP_PORT};
    let c = Config::from_str(MIN).unwrap();
    assert_eq!(
        (c.engines[0].role, c.engines[0].bootstrap_port),
        (Role::Both, None)
    );
    let c = Config::from_str(&one("vllm", "role = \"decode\"")).unwrap();
    assert_eq!(c.engines[0].role, Role::Decode);
    let e = err(&one("vllm", "role = \"producer\""));
    assert!(e.contains("key `role`: unknown variant"), "{e}");
    // A gateway routes whole requests to a fleet of its own.
    let e = err("[[engines]]\nurl = \"http://h:1\"\nflavor = \"gateway\"\nrole = \"prefill\"\n");
    assert!(
        e.contains("engines[0].role") && e.contains("gateway"),
        "{e}"
    );
    // Role "both" is every engine's, a gateway's too.
    Config::from_str("[[engines]]\nurl = \"http://h:1\"\nflavor = \"gateway\"\nrole = \"both\"\n")
        .unwrap();
    // A leg goes through the OpenAI HTTP front door: a gRPC-only engine takes none.
    let e = err("[[engines]]\ngrpc_url = \"http://h:9\"\nflavor = \"vllm\"\nrole = \"decode\"\n");
    assert!(e.contains("engines[0].role") && e.contains("url"), "{e}");
    // With its `url` beside the gRPC address it may.
    let both = "[[engines]]\nurl = \"http://h:1\"\ngrpc_url = \"http://h:9\"\nflavor = \"vllm\"\nrole = \"decode\"\n";
    assert_eq!(
        Config::from_str(both).unwrap().engines[0].role,
        Role::Decode
    );
    // SGLang's prefill servers get the default bootstrap port, or the one given.
    let c = Config::from_str(&one("sglang", "role = \"prefill\"")).unwrap();
    assert_eq!(c.engines[0].bootstrap_port, Some(SGLANG_BOOTSTRAP_PORT));
    assert_eq!(SGLANG_BOOTSTRAP_PORT, 8998);
    let c = Config::from_str(&one("sglang", "role = \"prefill\"\nbootstrap_port = 9100")).unwrap();
    assert_eq!(c.engines[0].bootstrap_port, Some(9100));
    // So does a prefill server whose flavor is read from it (it may be SGLang).
    let c = Config::from_str("[[engines]]\nurl = \"http://h:1\"\nrole = \"prefill\"\n").unwrap();
    assert_eq!(c.engines[0].bootstrap_port, Some(SGLANG_BOOTSTRAP_PORT));
    // A vLLM prefill server has none: it is set by accident.
    let c = Config::from_str(&one("vllm", "role = \"prefill\"")).unwrap();
    assert_eq!(c.engines[0].bootstrap_port, None);
    let e = err(&one("vllm", "role = \"prefill\"\nbootstrap_port = 8998"));
    assert!(
        e.contains("engines[0].bootstrap_port") && e.contains("vLLM"),
        "{e}"
    );
    // Nor has a decode server or a whole engine.
    for role in ["decode", "both"] {
        let e = err(&one(
            "sglang",
            &format!("role = \"{role}\"\nbootstrap_port = 8998"),
        ));
        assert!(
            e.contains("engines[0].bootstrap_port") && e.contains("only an SGLang prefill"),
            "{e}"
        );
    }
    let e = err(&one("sglang", "bootstrap_port = 8998"));
    assert!(e.contains("engines[0].bootstrap_port"), "{e}");
    // 0 is no port, whatever the role.
    let e = err(&one("sglang", "role = \"prefill\"\nbootstrap_port = 0"));
    assert!(
        e.contains("engines[0].bootstrap_port") && e.contains("0 is no port"),
        "{e}"
    );
    let e = err(&one("sglang", "role = \"prefill\"\nbootstrap_port = 70000"));
    assert!(e.contains("70000") || e.contains("bootstrap_port"), "{e}");
}

#[test]
fn a_discovery_template_takes_a_role_checked_at_load() {
    use super::super::engine::Role;
    let dns = "[[discovery]]\nkind = \"dns\"\nname = \"pd.svc\"\nport = 8000\ndp_size = 1\n";
    let c = Config::from_str(&format!("{dns}flavor = \"vllm\"\nrole = \"decode\"\n")).unwrap();
    assert_eq!(c.discovery[0].template.role(), Role::Decode);
    let found = c.discovery[0].template.engine(
        "x",
        "10.0.0.7".parse().unwrap(),
        Some(8000),
        None,
        Default::default(),
    );
    assert_eq!(found.unwrap().role, Role::Decode);
    // What a found engine would fail is refused at load, named by the entry.
    let e =
        err(&format!("{dns}flavor = \"gateway\"\nrole = \"prefill\"\n")
            .replace("dp_size = 1\n", ""));
    assert!(e.contains("discovery[0].role"), "{e}");
    let e = err(&format!(
        "{dns}flavor = \"vllm\"\nrole = \"prefill\"\nbootstrap_port = 8998\n"
    ));
    assert!(e.contains("discovery[0].bootstrap_port"), "{e}");
    let e = err(&format!(
        "{dns}flavor = \"sglang\"\nrole = \"decode\"\nbootstrap_port = 8998\n"
    ));
    assert!(e.contains("discovery[0].bootstrap_port"), "{e}");
}

#[test]
fn max_loras_defaults_to_the_engines_and_names_itself_when_out_of_range() {
    let c = Config::from_str(MIN).unwrap();
    assert_eq!(c.engines[0].max_loras, None);
    let c = Config::from_str(&one("vllm", "max_loras = 4")).unwrap();
    assert_eq!(c.engines[0].max_loras, Some(4));
    for bad in ["0", "257"] {
        let e = err(&one("vllm", &format!("max_loras = {bad}")));
        assert!(e.contains("engines[0].max_loras") && e.contains(bad), "{e}");
    }
    let e = err(&one("vllm", "max_loras = -1"));
    assert!(e.contains("max_loras"), "{e}");
}
