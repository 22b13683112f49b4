//! `rankgate mock-engine`'s flags, parsed as the command parses them.

use super::*;

fn parse(extra: &[&str]) -> Result<SimConfig, String> {
    let mut argv = vec![
        "--listen",
        "127.0.0.1:0",
        "--flavor",
        "vllm",
        "--dp-size",
        "2",
    ];
    argv.extend_from_slice(extra);
    super::parse(argv).map(|(cfg, _, _)| cfg)
}

#[test]
fn without_figures_a_rank_is_a_real_one_and_flags_still_set_them() {
    let cfg = parse(&[]).expect("valid");
    assert_eq!(cfg.capacity_tokens, deployment::CAPACITY_TOKENS);
    assert_eq!(cfg.decode_tokens_per_sec, deployment::DECODE_TOKENS_PER_SEC);
    assert_eq!(
        cfg.prefill_tokens_per_sec,
        deployment::PREFILL_TOKENS_PER_SEC
    );
    assert!(cfg.capacity_tokens > 100 * SimConfig::default().capacity_tokens);
    let small = parse(&[
        "--capacity-tokens",
        "4096",
        "--decode-rate",
        "200",
        "--prefill-rate",
        "20000",
    ])
    .expect("valid");
    let d = SimConfig::default();
    assert_eq!(
        (
            small.capacity_tokens,
            small.decode_tokens_per_sec,
            small.prefill_tokens_per_sec
        ),
        (
            d.capacity_tokens,
            d.decode_tokens_per_sec,
            d.prefill_tokens_per_sec
        )
    );
    let e = parse(&["--prefill-rate", "0"]).unwrap_err();
    assert!(e.contains("--prefill-rate"), "{e}");
}

#[test]
fn kv_events_config_reads_like_vllms_and_turns_prefix_caching_on() {
    let cfg = parse(&[
        "--kv-events-config",
        r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}"#,
    ])
    .expect("valid");
    assert!(cfg.prefix_caching);
    let kv = cfg.kv_events.expect("events on");
    assert_eq!(kv.topic, "kv");
    let off =
        parse(&["--kv-events-config", r#"{"enable_kv_cache_events": false}"#]).expect("valid");
    assert!(off.kv_events.is_none() && !off.prefix_caching);
    let bad = parse(&[
        "--kv-events-config",
        r#"{"enable_kv_cache_events": true, "publisher": "redis"}"#,
    ])
    .unwrap_err();
    assert!(bad.contains("publisher"), "{bad}");
    assert!(
        parse(&[]).expect("valid").kv_events.is_none(),
        "off by default"
    );
}

#[test]
fn pd_flags_set_the_role_and_its_settings_and_bad_seconds_name_the_flag() {
    let colocated = parse(&[]).expect("valid");
    assert!(colocated.role.is_none());
    assert_eq!(colocated.pd.kv_lease, super::super::pd::DEFAULT_KV_LEASE);
    let p = parse(&[
        "--role",
        "prefill",
        "--kv-lease",
        "0.5",
        "--side-port",
        "40100",
        "--engine-id",
        "pd-P",
    ])
    .expect("valid");
    assert_eq!(p.role, Some(super::super::PdRole::Prefill));
    assert_eq!(p.pd.kv_lease, std::time::Duration::from_millis(500));
    assert_eq!(
        (p.pd.side_port, p.pd.engine_id.as_deref()),
        (40100, Some("pd-P"))
    );
    let d = parse(&["--role", "decode", "--disaggregation-waiting-timeout", "2"]).expect("valid");
    assert_eq!(d.pd.waiting_timeout, std::time::Duration::from_secs(2));
    for flag in ["--kv-lease", "--disaggregation-bootstrap-timeout"] {
        let e = parse(&["--role", "prefill", flag, "0"]).unwrap_err();
        assert!(e.contains(flag), "{e}");
    }
}

#[test]
fn queue_flags_set_the_cap_and_the_policy_and_bad_ones_name_the_flag() {
    let d = parse(&[]).expect("valid");
    assert_eq!(d.max_num_seqs, deployment::MAX_NUM_SEQS);
    assert_eq!(d.scheduling_policy, super::super::SchedulingPolicy::Fcfs);
    let p = parse(&["--max-num-seqs", "2", "--scheduling-policy", "priority"]).expect("valid");
    assert_eq!(p.max_num_seqs, 2);
    assert_eq!(
        p.scheduling_policy,
        super::super::SchedulingPolicy::Priority
    );
    let e = parse(&["--max-num-seqs", "0"]).unwrap_err();
    assert!(e.contains("--max-num-seqs"), "{e}");
    let argv = [
        "--listen",
        "127.0.0.1:0",
        "--flavor",
        "sglang",
        "--scheduling-policy",
        "priority",
    ];
    let e = super::parse(argv).map(|_| ()).unwrap_err();
    assert!(e.contains("--scheduling-policy"), "{e}");
}

#[test]
fn lora_flags_read_like_vllms_and_bad_ones_name_the_flag() {
    assert!(parse(&[]).expect("valid").lora.is_none(), "off by default");
    let d = parse(&["--enable-lora"]).expect("valid").lora.expect("on");
    assert_eq!((d.max_loras, d.max_lora_rank), (1, 16), "vLLM's defaults");
    assert_eq!(d.load_delay, std::time::Duration::from_millis(25));
    let on = parse(&[
        "--enable-lora",
        "--lora-modules",
        "a=org/a",
        r#"{"name": "b", "path": "org/b", "base_model_name": "tiny-llama"}"#,
        "--max-loras",
        "2",
        "--allow-runtime-lora",
        "--lora-load-ms",
        "5",
    ])
    .expect("valid")
    .lora
    .expect("on");
    let names: Vec<&str> = on.modules.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(on.max_loras, 2);
    assert!(on.runtime_updating);
    assert_eq!(on.load_delay, std::time::Duration::from_millis(5));
    for (extra, flag) in [
        (&["--enable-lora", "--max-loras", "0"][..], "--max-loras"),
        (
            &["--enable-lora", "--max-lora-rank", "12"],
            "--max-lora-rank",
        ),
        (&["--lora-modules", "a=org/a"], "--enable-lora"),
        (&["--allow-runtime-lora"], "--enable-lora"),
        (
            &["--enable-lora", "--lora-modules", "a=/nonexistent/a"],
            "No adapter found",
        ),
        (
            &["--enable-lora", "--lora-modules", "nothing"],
            "--lora-modules",
        ),
        (
            &["--enable-lora", "--lora-load-ms", "600000"],
            "--lora-load-ms",
        ),
    ] {
        let e = parse(extra).map(|_| ()).unwrap_err();
        assert!(e.contains(flag), "{extra:?}: {e}");
    }
    let argv = [
        "--listen",
        "127.0.0.1:0",
        "--flavor",
        "sglang",
        "--enable-lora",
    ];
    let e = super::parse(argv).map(|_| ()).unwrap_err();
    assert!(e.contains("--enable-lora"), "{e}");
}
