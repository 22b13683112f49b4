//! The real `rankgate serve` binary as a test's child process: its ports read from its own
//! `rankgate serving` log line, its stderr kept, signals sent, exit awaited (all bounded).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::loopback;

/// The `rankgate serve` binary on ports it picked itself (the config says port 0; the bound ports
/// come from its `rankgate serving` log line), killed when dropped whatever the test did.
pub struct Rankgate {
    child: Child,
    pub pid: i32,
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// Every stderr line so far; `lines_seen` ticks with each one.
    log: Arc<Mutex<Vec<String>>>,
    lines_seen: watch::Receiver<usize>,
    config: PathBuf,
}

impl Drop for Rankgate {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

impl Rankgate {
    /// Starts `rankgate serve` with `config` (which must listen on port 0), optionally under
    /// RLIMIT_NOFILE `nofile`, and returns once it logs the ports it serves on.
    pub async fn start(name: &str, config: &str, nofile: Option<u64>) -> Rankgate {
        Rankgate::start_until(name, config, nofile, None).await
    }

    /// [`Rankgate::start`], returning as soon as a stderr line holds `early` (when given; a line
    /// logged before the ports bind), the ports then read later by [`Rankgate::serving`].
    pub async fn start_until(
        name: &str,
        config: &str,
        nofile: Option<u64>,
        early: Option<&str>,
    ) -> Rankgate {
        let path = std::env::temp_dir().join(format!(
            "rankgate-faults-{}-{name}.toml",
            std::process::id()
        ));
        std::fs::write(&path, config).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rankgate"));
        cmd.args(["serve", "--config"])
            .arg(&path)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(n) = nofile {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit is async-signal-safe and touches only the child's limits.
            unsafe {
                cmd.pre_exec(move || {
                    let lim = libc::rlimit {
                        rlim_cur: n as libc::rlim_t,
                        rlim_max: n as libc::rlim_t,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().expect("spawn rankgate");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, lines_seen) = watch::channel(0usize);
        {
            let log = log.clone();
            // A thread drains stderr so the child never blocks on a full pipe.
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    if std::env::var_os("RANKGATE_TEST_LOG").is_some() {
                        eprintln!("[rankgate] {line}");
                    }
                    let n = {
                        let mut l = log.lock().unwrap();
                        l.push(line);
                        l.len()
                    };
                    tx.send_replace(n);
                }
            });
        }
        let pid = child.id() as i32;
        let mut rg = Rankgate {
            child,
            pid,
            addr: loopback(),
            admin_addr: loopback(),
            log,
            lines_seen,
            config: path,
        };
        match early {
            Some(needle) => {
                rg.wait_log(needle, Duration::from_secs(20)).await;
            }
            None => rg.serving().await,
        }
        rg
    }

    /// Waits (bounded) for the `rankgate serving` line and reads the bound ports from it.
    pub async fn serving(&mut self) {
        let line = self
            .wait_log("rankgate serving", Duration::from_secs(20))
            .await;
        let field = |key: &str| -> SocketAddr {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {key} in {line}"))
        };
        self.addr = field("addr=");
        self.admin_addr = field("admin_addr=");
    }

    /// The stderr lines so far.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// How many stderr lines so far contain `needle`.
    pub fn count(&self, needle: &str) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// Waits (bounded) for a stderr line containing `needle` and returns it.
    pub async fn wait_log(&mut self, needle: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(l) = self.log.lock().unwrap().iter().find(|l| l.contains(needle)) {
                return l.clone();
            }
            let changed = tokio::time::timeout_at(deadline, self.lines_seen.changed()).await;
            match changed {
                Ok(Ok(())) => {}
                // The child closed stderr (it exited): one last look, then give up.
                Ok(Err(_)) | Err(_) => {
                    if let Some(l) = self.log.lock().unwrap().iter().find(|l| l.contains(needle)) {
                        return l.clone();
                    }
                    panic!(
                        "no log line with {needle:?} within {limit:?}; stderr:\n{}",
                        self.log().join("\n")
                    );
                }
            }
        }
    }

    pub fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.pid, sig) };
        assert_eq!(rc, 0, "kill({}, {sig})", self.pid);
    }

    /// Waits (bounded) for the process to exit.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Runs one of the binary's client tools (`rankgate <args>`) to its end, off the runtime's
/// threads: with `--admin-token token` when given, and never a token from the test's own
/// environment (`RANKGATE_ADMIN_TOKEN`).
pub async fn run_tool(args: Vec<String>, token: Option<&'static str>) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        let mut c = Command::new(env!("CARGO_BIN_EXE_rankgate"));
        c.args(args).env_remove("RANKGATE_ADMIN_TOKEN");
        if let Some(t) = token {
            c.args(["--admin-token", t]);
        }
        c.output().expect("run the rankgate binary")
    })
    .await
    .expect("the tool's thread")
}
