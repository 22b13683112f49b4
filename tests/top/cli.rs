//! The `rankgate top` subcommand as a process: what it refuses, and its end when its terminal
//! goes away.

/// The binary: bad arguments are named, and without a terminal it says so and exits at once
/// (never drawing escape codes into a pipe).
#[test]
fn the_subcommand_refuses_what_it_cannot_do() {
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_rankgate"))
            .arg("top")
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run rankgate top")
    };
    let o = run(&["--admin", "http://127.0.0.1:9"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("not a terminal"), "{err}");
    assert!(o.stdout.is_empty());

    let o = run(&["--admin", "ftp://127.0.0.1:9"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("http:// or https://"), "{err}");

    let o = run(&[
        "--admin",
        "https://127.0.0.1:9",
        "--ca-file",
        "/no/such/ca.pem",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("/no/such/ca.pem"), "{err}");

    let o = run(&["--admin", "http://127.0.0.1:9", "--interval", "10ms"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("within 100ms and 60s"), "{err}");
}

/// A dropped SSH session: `top` runs on a pty as its controlling terminal, draws, and then the
/// pty's other end is closed. It must end within a few seconds (it once spun a core forever,
/// deaf to SIGHUP, SIGTERM and SIGINT, joining an input thread stuck on the dead terminal).
#[test]
fn top_ends_when_its_terminal_goes_away() {
    use std::io::Read;
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty writes two descriptors it opened, which are then owned here.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // Neither end may leak into a child (top itself included): an open master keeps the
    // terminal alive.
    for fd in [master, slave] {
        // SAFETY: fcntl on descriptors this test owns.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rankgate"));
    cmd.args(["top", "--admin", "http://127.0.0.1:9"])
        .stdin(Stdio::from(slave.try_clone().unwrap()))
        .stdout(Stdio::from(slave.try_clone().unwrap()))
        .stderr(Stdio::from(slave));
    // SAFETY: only async-signal-safe calls between fork and exec. A session of its own with the
    // pty as controlling terminal, as a shell's child in an SSH session has.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            libc::ioctl(0, libc::TIOCSCTTY as _, 0);
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("start rankgate top");
    drop(cmd);
    // Wait until it has drawn (switched to the alternate screen), read on a thread so the wait
    // is bounded.
    let mut reader = std::fs::File::from(master);
    let (tx, rx) = std::sync::mpsc::channel();
    let read = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        let n = reader.read(&mut buf).unwrap_or(0);
        let _ = tx.send(n);
        reader // closed when the test drops it
    });
    let drew = rx.recv_timeout(Duration::from_secs(20)).unwrap_or(0);
    let master = read.join().unwrap();
    assert!(drew > 0, "top drew nothing");
    drop(master); // the terminal goes away
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let status = status.expect("top still running 10 s after its terminal went away");
    assert_ne!(status.code(), Some(101), "it panicked on the way out");
}
