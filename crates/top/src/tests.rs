use super::*;

fn press(code: KeyCode) -> KeyEvent {
    KeyEvent::new(code, KeyModifiers::NONE)
}

#[test]
fn admin_urls_are_checked() {
    assert_eq!(
        admin_base("http://127.0.0.1:9090/").unwrap(),
        "http://127.0.0.1:9090"
    );
    assert_eq!(
        admin_base("127.0.0.1:9090").unwrap(),
        "http://127.0.0.1:9090"
    );
    assert_eq!(
        admin_base("http://[::1]:9090").unwrap(),
        "http://[::1]:9090"
    );
    assert_eq!(admin_base("https://h:1/").unwrap(), "https://h:1");
    for bad in ["ftp://h:1", "http://", "http://h:1/?x=1", "http://h:x"] {
        assert!(admin_base(bad).is_err(), "{bad}");
    }
    let e = Top::new("ftp://h:1", DEFAULT_INTERVAL).err().unwrap();
    assert!(e.to_string().contains("https://"), "{e}");
}

#[test]
fn intervals_are_bounded() {
    assert_eq!(parse_interval("1s"), Ok(Duration::from_secs(1)));
    assert_eq!(parse_interval("250ms"), Ok(Duration::from_millis(250)));
    assert!(parse_interval("10ms").is_err());
    assert!(parse_interval("2m").is_err());
    assert!(parse_interval("1").is_err());
}

#[test]
fn keys_sort_filter_scroll_and_quit() {
    let mut s = State::new("http://x", DEFAULT_INTERVAL);
    assert_eq!(
        handle_key(&mut s, press(KeyCode::Char('s')), 20),
        Action::Continue
    );
    assert_eq!(s.sort, SortKey::Kv);
    handle_key(&mut s, press(KeyCode::Char('S')), 20);
    assert_eq!(s.sort, SortKey::Id);
    handle_key(&mut s, press(KeyCode::Char('r')), 20);
    assert!(s.reversed);
    // `/` opens the prompt; `q` typed there is text, not quit.
    handle_key(&mut s, press(KeyCode::Char('/')), 20);
    for c in "llqx".chars() {
        assert_eq!(
            handle_key(&mut s, press(KeyCode::Char(c)), 20),
            Action::Continue
        );
    }
    handle_key(&mut s, press(KeyCode::Backspace), 20);
    assert_eq!(s.editing.as_deref(), Some("llq"));
    handle_key(&mut s, press(KeyCode::Enter), 20);
    assert_eq!((s.filter.as_str(), s.editing.is_none()), ("llq", true));
    // Esc in the prompt keeps the old filter; outside it clears the filter.
    handle_key(&mut s, press(KeyCode::Char('/')), 20);
    handle_key(&mut s, press(KeyCode::Char('z')), 20);
    handle_key(&mut s, press(KeyCode::Esc), 20);
    assert_eq!(s.filter, "llq");
    handle_key(&mut s, press(KeyCode::Esc), 20);
    assert_eq!(s.filter, "");
    // Releases are not presses.
    let mut release = press(KeyCode::Char('q'));
    release.kind = KeyEventKind::Release;
    assert_eq!(handle_key(&mut s, release, 20), Action::Continue);
    assert_eq!(
        handle_key(&mut s, press(KeyCode::Char('q')), 20),
        Action::Quit
    );
    let ctrl_c = KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL);
    assert_eq!(handle_key(&mut s, ctrl_c, 20), Action::Quit);
    // Ctrl-C quits from the prompt too.
    handle_key(&mut s, press(KeyCode::Char('/')), 20);
    assert_eq!(handle_key(&mut s, ctrl_c, 20), Action::Quit);
}
