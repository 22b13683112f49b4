use std::time::Duration;

use super::super::polling::DEFAULT_HEALTH_FAILURES;
use super::super::whole::Config;
use super::*;

fn engine(url: &str, flavor: &str, dp: u32, start: u32) -> String {
    format!(
        "[[engines]]\nurl = \"{url}\"\nflavor = \"{flavor}\"\ndp_size = {dp}\nstart_rank = {start}\n"
    )
}

fn err(text: &str) -> String {
    Config::from_str(text).unwrap_err().to_string()
}

#[test]
fn overlapping_ranks_name_both_engines() {
    let e = err(&format!(
        "{}{}",
        engine("http://a:1", "vllm", 4, 0),
        engine("http://b:1", "sglang", 2, 3)
    ));
    assert!(e.contains("engines[1].start_rank"), "{e}");
    assert!(
        e.contains("http://a:1") && e.contains("http://b:1") && e.contains("rank(s) 3"),
        "{e}"
    );
    let e = err(&format!(
        "{}{}",
        engine("http://a:1", "vllm", 4, 4),
        engine("http://b:1", "vllm", 8, 0)
    ));
    assert!(e.contains("rank(s) 4-7"), "{e}");
    // Adjacent ranges and gateways are fine.
    Config::from_str(&format!(
        "{}{}[[engines]]\nurl = \"http://g:1\"\nflavor = \"gateway\"\n",
        engine("http://a:1", "vllm", 2, 0),
        engine("http://b:1", "vllm", 2, 2)
    ))
    .unwrap();
}

#[test]
fn independent_engines_never_conflict_and_groups_are_checked_apart() {
    let own = |url: &str| format!("[[engines]]\nurl = \"{url}\"\nflavor = \"vllm\"\ndp_size = 2\n");
    let member = |url: &str, group: &str, start: u32| {
        format!("{}dp_group = \"{group}\"\nstart_rank = {start}\n", own(url))
    };
    // Three servers each with ranks 0-1, and two groups both starting at 0.
    let c = Config::from_str(&format!(
        "{}{}{}{}{}",
        own("http://a:1"),
        own("http://b:1"),
        own("http://c:1"),
        member("http://d:1", "x", 0),
        member("http://e:1", "y", 0),
    ))
    .unwrap();
    let ranks: Vec<_> = c.engines.iter().map(|e| e.ranks()).collect();
    assert_eq!(ranks, [0..2, 0..2, 0..2, 0..2, 0..2]);
    assert_eq!(c.engines[0].deployment, Deployment::Own);
    // A named group beside the unnamed one (start_rank alone): apart too.
    Config::from_str(&format!(
        "{}{}",
        member("http://d:1", "x", 0),
        engine("http://f:1", "vllm", 2, 0)
    ))
    .unwrap();
    // Inside a group, an overlap names both members and the group.
    let e = err(&format!(
        "{}{}",
        member("http://d:1", "x", 0),
        member("http://e:1", "x", 1)
    ));
    assert!(
        e.contains("engines[1].start_rank")
            && e.contains("http://d:1")
            && e.contains("http://e:1")
            && e.contains("DP group \"x\""),
        "{e}"
    );
    // The same URL twice is still an error, independent or not.
    let e = err(&format!("{}{}", own("http://a:1"), own("http://a:1")));
    assert!(e.contains("duplicate"), "{e}");
}

#[test]
fn shape_keys_are_checked() {
    let e = err("[[engines]]\nurl = \"http://g:1\"\nflavor = \"gateway\"\ndp_group = \"x\"\n");
    assert!(e.contains("engines[0].dp_group"), "{e}");
    let e = err("[[engines]]\nurl = \"http://a:1\"\ndp_group = \" \"\n");
    assert!(e.contains("engines[0].dp_group"), "{e}");
    let e = err("[[engines]]\nurl = \"http://a:1\"\ntelemetry = [\"prometheus\"]\n");
    assert!(
        e.contains("engines[0].telemetry") && e.contains("flavor"),
        "{e}"
    );
    // url alone: flavor and size are the engine's to say, so it starts without workers.
    let c = Config::from_str("[[engines]]\nurl = \"http://a:1\"\n").unwrap();
    let e = &c.engines[0];
    assert_eq!(
        (e.declared.flavor, e.declared.dp_size, e.dp_size),
        (None, None, 0)
    );
    assert!(!e.shaped());
    // A member's size is its configured share, 1 when unset (as before dp_group).
    let c = Config::from_str(
        "[[engines]]\nurl = \"http://a:1\"\nflavor = \"sglang\"\nstart_rank = 4\n",
    )
    .unwrap();
    assert_eq!(c.engines[0].ranks(), 4..5);
}

#[test]
fn telemetry_bounds() {
    let base = engine("http://a:1", "vllm", 1, 0);
    let e = err(&format!("[telemetry]\ninterval = \"5ms\"\n{base}"));
    assert!(e.contains("telemetry.interval"), "{e}");
    let e = err(&format!(
        "[telemetry]\ninterval = \"2m\"\nstale_after = \"5m\"\n{base}"
    ));
    assert!(e.contains("telemetry.interval"), "{e}");
    let e = err(&format!("[telemetry]\ntimeout = \"1ms\"\n{base}"));
    assert!(e.contains("telemetry.timeout"), "{e}");
    let e = err(&format!("[telemetry]\nstale_after = \"61m\"\n{base}"));
    assert!(e.contains("telemetry.stale_after"), "{e}");
    let e = err(&format!("[telemetry]\nhealth_failures = 0\n{base}"));
    assert!(e.contains("telemetry.health_failures"), "{e}");
    let e = err(&format!("[telemetry]\nmax_concurrent_polls = 0\n{base}"));
    assert!(e.contains("telemetry.max_concurrent_polls"), "{e}");
    let c = Config::from_str(&format!(
        "[telemetry]\ninterval = \"10ms\"\nstale_after = \"60m\"\ntimeout = \"10ms\"\nhealth_failures = 1\n{base}"
    ))
    .unwrap();
    assert_eq!(c.telemetry.interval, Duration::from_millis(10));
    assert_eq!(c.telemetry.health_failures, 1);
    let c = Config::from_str(&base).unwrap();
    assert_eq!(c.telemetry.health_failures, DEFAULT_HEALTH_FAILURES);
    assert_eq!(
        c.telemetry.max_concurrent_polls,
        super::super::polling::DEFAULT_MAX_CONCURRENT_POLLS
    );
}

#[test]
fn health_path_defaults_by_flavor() {
    let c = Config::from_str(&format!(
        "{}{}[[engines]]\nurl = \"http://g:1\"\nflavor = \"gateway\"\n{}health_path = \"\"\n",
        engine("http://a:1", "vllm", 1, 0),
        engine("http://b:1", "sglang", 1, 1),
        engine("http://c:1", "vllm", 1, 2),
    ))
    .unwrap();
    let paths: Vec<Option<&str>> = c.engines.iter().map(|e| e.health_path.as_deref()).collect();
    assert_eq!(paths, [Some("/health"), Some("/health"), None, None]);
    let g = Config::from_str(
        "[[engines]]\nurl = \"http://g:1\"\nflavor = \"gateway\"\nhealth_path = \"/ready\"\n",
    )
    .unwrap();
    assert_eq!(g.engines[0].health_path.as_deref(), Some("/ready"));
    let e = err(&format!(
        "{}health_path = \"health\"\n",
        engine("http://a:1", "vllm", 1, 0)
    ));
    assert!(e.contains("engines[0].health_path"), "{e}");
}

#[test]
fn engines_resolving_to_one_address_are_warned_about() {
    let c = Config::from_str(&format!(
        "{}{}{}",
        engine("http://a:1", "vllm", 1, 0),
        engine("http://b:1", "vllm", 1, 1),
        engine("http://c:1", "vllm", 1, 2),
    ))
    .unwrap();
    let same: SocketAddr = "10.0.0.7:8000".parse().unwrap();
    let other: SocketAddr = "10.0.0.8:8000".parse().unwrap();
    let named = |i: usize, addrs: Result<Vec<SocketAddr>, String>| Resolved {
        name: format!("engines[{i}] ({})", c.engines[i].url),
        addrs,
        concerned: true,
    };
    let mut resolved = vec![
        named(0, Ok(vec![same])),
        named(1, Ok(vec![other, same])),
        named(2, Err("no such host".into())),
    ];
    let w = address_warnings(&resolved);
    assert_eq!(w.len(), 2, "{w:?}");
    assert!(
        w[0].contains("engines[0]")
            && w[0].contains("engines[1]")
            && w[0].contains("10.0.0.7:8000"),
        "{w:?}"
    );
    assert!(
        w[1].contains("engines[2] (http://c:1)") && w[1].contains("no such host"),
        "{w:?}"
    );
    // A runtime change warns about the engines it brings only: b alone is new here.
    for (i, r) in resolved.iter_mut().enumerate() {
        r.concerned = i == 1;
    }
    let w = address_warnings(&resolved);
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("engines[1] (http://b:1)"), "{w:?}");
    resolved[1].concerned = false;
    assert!(address_warnings(&resolved).is_empty());
}

#[test]
fn localhost_and_loopback_ip_are_one_server() {
    let c = Config::from_str(&format!(
        "{}{}",
        engine("http://localhost:18000", "vllm", 1, 0),
        engine("http://127.0.0.1:18000", "vllm", 1, 1),
    ))
    .unwrap();
    let w = c.warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("127.0.0.1:18000"), "{w:?}");
}
