//! The run's progress on stderr: a bar redrawn in place on a terminal, a plain line now and
//! then otherwise.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

fn bar(done: usize, total: usize) -> String {
    const WIDTH: usize = 40;
    let filled = (done * WIDTH)
        .checked_div(total)
        .unwrap_or(WIDTH)
        .min(WIDTH);
    format!(
        "  [{}{}] {done}/{total} requests",
        "#".repeat(filled),
        ".".repeat(WIDTH - filled)
    )
}

/// The bar's last state on a terminal; the total in a plain line otherwise.
pub(super) fn end_progress(done: usize, total: usize) {
    let mut err = std::io::stderr();
    let _ = match err.is_terminal() {
        true => writeln!(err, "\r{}", bar(done, total)),
        false => writeln!(err, "  {done}/{total} requests done"),
    };
}

/// A bar redrawn in place on a terminal; without one (CI, a pipe, `tee`) a plain line every
/// 5 s, so a long run still shows it is moving.
pub(super) fn spawn_progress(done: Arc<AtomicUsize>, total: usize) -> tokio::task::JoinHandle<()> {
    let tty = std::io::stderr().is_terminal();
    let period = Duration::from_millis(if tty { 250 } else { 5000 });
    tokio::spawn(async move {
        let started = Instant::now();
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        loop {
            tick.tick().await;
            let mut err = std::io::stderr();
            let _ = match tty {
                true => write!(err, "\r{}", bar(done.load(Relaxed), total)),
                false => writeln!(
                    err,
                    "  {}/{total} requests after {} s",
                    done.load(Relaxed),
                    started.elapsed().as_secs()
                ),
            };
            let _ = err.flush();
        }
    })
}
