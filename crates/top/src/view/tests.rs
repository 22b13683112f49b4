use super::*;

#[test]
fn prefill_and_decode_ranks_are_marked_and_whole_ones_are_not() {
    let row = |id: &str, role: Option<&str>| Row {
        id: id.into(),
        role: role.map(Into::into),
        ..Row::default()
    };
    let p = rank_cell(&row("http://10.0.0.1:8000@0", Some("prefill")), 25);
    let d = rank_cell(&row("http://10.0.0.2:8000@1", Some("decode")), 25);
    let w = rank_cell(&row("http://10.0.0.3:8000@2", Some("both")), 25);
    let old = rank_cell(&row("http://10.0.0.3:8000@2", None), 25);
    assert_eq!(p, format!("{:<23} P", "10.0.0.1:8000@0"));
    assert_eq!(d, format!("{:<23} D", "10.0.0.2:8000@1"));
    assert_eq!(w, format!("{:<25}", "10.0.0.3:8000@2"));
    assert_eq!(old, w, "a router older than roles: whole engines");
    // A long id gives way to the mark; the rank number stays.
    let long = rank_cell(
        &row(
            "http://vllm-prefill-0.vllm.svc.cluster.local:8000@12",
            Some("prefill"),
        ),
        25,
    );
    assert_eq!(long.chars().count(), 25, "{long}");
    assert!(long.ends_with("@12 P"), "{long}");
}

#[test]
fn ages_fit_their_column() {
    for ms in [
        0,
        999,
        1_000,
        9_949,
        9_999,
        10_000,
        99_999,
        100_000,
        5_999_999,
        u64::MAX,
    ] {
        assert!(
            fmt_age(ms).chars().count() <= AGE_W,
            "{ms}: {}",
            fmt_age(ms)
        );
    }
    assert_eq!(fmt_age(3_210), "3.2s");
}

#[test]
fn bars_fill_by_eighths() {
    let text = |kv| {
        kv_bar(Some(kv))
            .iter()
            .map(|s| s.content.to_string())
            .collect::<String>()
    };
    assert_eq!(text(0.0), "░░░░░░░░   0%");
    assert_eq!(text(0.5), "████░░░░  50%");
    assert_eq!(text(0.53), "████▎░░░  53%");
    assert_eq!(text(1.2), "████████ 120%");
    assert_eq!(kv_bar(Some(f64::NAN))[1].content, "    -");
}

#[test]
fn reasons_wrap_between_words() {
    let text = "health: client error (Connect): tcp connect error: Connection refused";
    assert_eq!(
        wrap_words(text, 20, 30, 3),
        [
            "health: client error",
            "(Connect): tcp connect error:",
            "Connection refused"
        ]
    );
    assert_eq!(
        wrap_words(text, 20, 30, 2),
        ["health: client error", "(Connect): tcp connect error:…"]
    );
    assert_eq!(
        wrap_words("abcdefghij kl", 4, 4, 5),
        ["abcd", "efgh", "ij", "kl"]
    );
    assert_eq!(wrap_words("", 4, 4, 2), [""]);
    for (first, rest) in [(0, 0), (1, 1), (3, 7)] {
        for line in wrap_words(text, first, rest, 4) {
            assert!(line.chars().count() <= first.max(rest).max(1), "{line}");
        }
    }
}

#[test]
fn a_failing_admin_with_no_rows_shows_its_whole_error() {
    let mut state = State::new("https://127.0.0.1:9090", std::time::Duration::from_secs(1));
    assert!(whole_error(&state, 80, 20).is_none());
    let error = format!(
        "invalid peer certificate: Other(OtherError(CaUsedAsEndEntity)): {}",
        rankgate::tls::CA_AS_SERVER_ADVICE
    );
    state.failed(error.clone());
    let lines = whole_error(&state, 80, 20).unwrap();
    let shown: Vec<String> = (lines.iter())
        .map(|l| l.spans.iter().map(|s| s.content.trim()).collect())
        .collect();
    let whole = format!("admin unreachable: {error}");
    assert_eq!(
        shown.join(" "),
        whole.split_whitespace().collect::<Vec<_>>().join(" ")
    );
    assert!(lines.iter().all(|l| l.width() <= 80));
}

#[test]
fn the_columns_fill_80() {
    assert_eq!(80 - FIXED_W, 18);
    assert_eq!(rows_on_screen(24), 20);
}
