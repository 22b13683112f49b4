//! `rankgate top`: a live terminal view of every rank of a running rankgate, read from its admin
//! listener (`GET /workers`, and `GET /metrics` for requests per second and, when the router
//! runs flow control, its queue).
//!
//! This crate's root owns the parts that touch the world: the terminal (raw mode and the alternate
//! screen, always given back, on panic too), the keyboard, the polling task, and the loop that
//! joins them. What is known lives in [`model`] ([`rates`], [`flow`]), how it looks in [`view`]
//! ([`status`], [`queue`]), all pure, so [`Top::poll_once`] and [`render`] drive them headless (ratatui's `TestBackend`).
//!
//! The admin listener is read-only here and never trusted to answer: every poll has a timeout,
//! a failed one keeps the last rows on screen marked stale, and a rank that left the fleet just
//! loses its row.

mod fetch;
pub mod flow;
pub mod model;
pub mod queue;
pub mod rates;
pub mod status;
pub mod view;

use std::io::{self, IsTerminal};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};
use std::time::Duration;

use crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use crossterm::terminal::{self, EnterAlternateScreen, LeaveAlternateScreen};
use crossterm::{cursor, execute};
use http::Uri;
use ratatui::backend::{Backend, CrosstermBackend};
use ratatui::Terminal;
use tokio::sync::mpsc;
use tokio::time::Instant;

use fetch::{Fetched, Fetcher};

pub use model::{Row, SortKey, State};

/// `--interval` when none is given.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);
/// Bounds of `--interval`: faster is noise for a person, slower is not live.
const MIN_INTERVAL: Duration = Duration::from_millis(100);
const MAX_INTERVAL: Duration = Duration::from_secs(60);
/// How long the input thread blocks for a key before it looks whether it should stop.
const INPUT_POLL: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum TopError {
    #[error("--admin {url:?}: {problem}")]
    Admin { url: String, problem: String },
    #[error("rankgate top reads keys from standard input and draws on standard output, and one of them is not a terminal: run it in an interactive shell (or read GET /workers on the admin listener)")]
    NotATerminal,
    #[error("terminal: {0}")]
    Terminal(#[from] io::Error),
}

/// Parses `--interval` (`500ms`, `2s`), within 100 ms to 60 s.
pub fn parse_interval(s: &str) -> Result<Duration, String> {
    let d = rankgate::config::parse_duration(s)?;
    if !(MIN_INTERVAL..=MAX_INTERVAL).contains(&d) {
        return Err(format!("interval {s:?} must be within 100ms and 60s"));
    }
    Ok(d)
}

/// The admin URL as given (`http://host:port`, `https://host:port` for an admin listener with
/// `server.admin_tls`, or just `host:port`), without its last `/`.
fn admin_base(admin: &str) -> Result<String, TopError> {
    let bad = |problem: &str| TopError::Admin {
        url: admin.to_string(),
        problem: problem.to_string(),
    };
    let (scheme, rest) = admin
        .trim()
        .split_once("://")
        .unwrap_or(("http", admin.trim()));
    if scheme != "http" && scheme != "https" {
        return Err(bad("the admin listener is an http:// or https:// URL"));
    }
    let base = format!("{scheme}://{}", rest.trim_end_matches('/'));
    let uri: Uri = base
        .parse()
        .map_err(|e: http::uri::InvalidUri| bad(&e.to_string()))?;
    if uri.host().is_none_or(str::is_empty) {
        return Err(bad("no host (expected http://HOST:PORT)"));
    }
    let authority = uri.authority().map_or("", |a| a.as_str());
    let after_host = &authority[authority.rfind(']').map_or(0, |i| i + 1)..];
    if after_host.contains(':') && uri.port_u16().is_none() {
        return Err(bad("the port is not a number"));
    }
    if uri.query().is_some() {
        return Err(bad(
            "a query string has no place here (expected http://HOST:PORT)",
        ));
    }
    Ok(base)
}

/// The view's state and the means to refresh it from one admin listener.
pub struct Top {
    fetcher: Fetcher,
    state: State,
}

impl Top {
    /// Checks the admin URL; nothing is sent until [`Top::poll_once`] (or [`run`]). An
    /// `https://` admin listener is verified against the system's roots.
    pub fn new(admin: &str, interval: Duration) -> Result<Top, TopError> {
        Top::with_tls(admin, interval, rankgate::tls::Upstream::system())
    }

    /// [`Top::new`], verifying an `https://` admin listener as `tls` says.
    pub fn with_tls(
        admin: &str,
        interval: Duration,
        tls: &rankgate::tls::Upstream,
    ) -> Result<Top, TopError> {
        let base = admin_base(admin)?;
        let uri = |path: &str| -> Result<Uri, TopError> {
            format!("{base}{path}")
                .parse()
                .map_err(|e: http::uri::InvalidUri| TopError::Admin {
                    url: admin.to_string(),
                    problem: e.to_string(),
                })
        };
        // A poll may take up to its interval, but a short interval still gets a fair chance to
        // hear from a loaded admin listener, and a long one does not hang that long.
        let timeout = interval.clamp(Duration::from_secs(2), Duration::from_secs(10));
        Ok(Top {
            fetcher: Fetcher {
                client: rankgate::http::client_with(timeout, tls),
                workers: uri("/workers")?,
                metrics: uri("/metrics")?,
                timeout,
            },
            state: State::new(base, interval),
        })
    }

    pub fn state(&self) -> &State {
        &self.state
    }

    pub fn state_mut(&mut self) -> &mut State {
        &mut self.state
    }

    /// Reads `/workers` and `/metrics` once and updates the state: fresh rows, or the last ones
    /// kept and marked stale with why. Never fails, never panics on what the admin answers.
    pub async fn poll_once(&mut self) {
        let fetched = self.fetcher.fetch().await;
        self.apply(fetched);
    }

    fn apply(&mut self, f: Fetched) {
        match f.workers {
            // A body that does not parse is recorded as the outage by `State::apply` itself.
            Ok(body) => {
                let _ = self
                    .state
                    .apply(f.at, &body, f.metrics.as_deref().map_err(Clone::clone));
            }
            Err(e) => self.state.failed(e),
        }
    }
}

/// Draws `state` on `terminal` (a real one, or a `TestBackend`).
pub fn render<B: Backend>(state: &State, terminal: &mut Terminal<B>) -> io::Result<()> {
    let now = Instant::now();
    terminal.draw(|frame| view::draw(frame, state, now))?;
    Ok(())
}

/// What a key asks of the loop.
#[derive(Debug, PartialEq, Eq)]
pub enum Action {
    Continue,
    Quit,
}

/// Applies one key press to the state; `page` is how many rows the screen shows.
pub fn handle_key(state: &mut State, key: KeyEvent, page: usize) -> Action {
    if key.kind == KeyEventKind::Release {
        return Action::Continue;
    }
    let ctrl = key.modifiers.contains(KeyModifiers::CONTROL);
    if ctrl && matches!(key.code, KeyCode::Char('c') | KeyCode::Char('d')) {
        return Action::Quit;
    }
    if let Some(text) = &mut state.editing {
        match key.code {
            KeyCode::Enter => {
                state.filter = text.trim().to_string();
                state.editing = None;
                state.scroll = 0;
            }
            KeyCode::Esc => state.editing = None,
            KeyCode::Backspace => {
                text.pop();
            }
            KeyCode::Char(c) if !ctrl => text.push(c),
            _ => {}
        }
        return Action::Continue;
    }
    let page = page.max(1) as isize;
    match key.code {
        KeyCode::Char('q') => return Action::Quit,
        KeyCode::Char('s') => state.sort = state.sort.next(),
        KeyCode::Char('S') => state.sort = state.sort.prev(),
        KeyCode::Char('r') => state.reversed = !state.reversed,
        KeyCode::Char('/') => state.editing = Some(state.filter.clone()),
        // Esc clears a filter (there is nothing else to leave).
        KeyCode::Esc => {
            state.filter.clear();
            state.scroll = 0;
        }
        KeyCode::Up | KeyCode::Char('k') => state.scroll_by(-1, page as usize),
        KeyCode::Down | KeyCode::Char('j') => state.scroll_by(1, page as usize),
        KeyCode::PageUp => state.scroll_by(-page, page as usize),
        KeyCode::PageDown | KeyCode::Char(' ') => state.scroll_by(page, page as usize),
        KeyCode::Home | KeyCode::Char('g') => state.scroll = 0,
        KeyCode::End | KeyCode::Char('G') => state.scroll_by(isize::MAX, page as usize),
        _ => {}
    }
    Action::Continue
}

/// Whether this process has the terminal in raw mode on the alternate screen right now.
static TERMINAL_TAKEN: AtomicBool = AtomicBool::new(false);

/// Gives the terminal back: raw mode off, the alternate screen left, the cursor shown. Once,
/// whoever calls first: the guard's drop or the panic hook.
fn restore_terminal() {
    if TERMINAL_TAKEN.swap(false, Ordering::SeqCst) {
        // Raw mode first: it has the larger effect on a shell left behind.
        let _ = terminal::disable_raw_mode();
        let _ = execute!(io::stdout(), LeaveAlternateScreen, cursor::Show);
    }
}

/// Holds the terminal in raw mode on the alternate screen; dropping it gives it back. A panic
/// anywhere gives it back too, before the panic message prints (so the message is readable).
struct TerminalGuard;

impl TerminalGuard {
    fn take() -> io::Result<TerminalGuard> {
        static HOOK: Once = Once::new();
        HOOK.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                restore_terminal();
                previous(info);
            }));
        });
        TERMINAL_TAKEN.store(true, Ordering::SeqCst);
        // From here on a failure gives back whatever was taken (the guard's drop).
        let guard = TerminalGuard;
        terminal::enable_raw_mode()?;
        execute!(io::stdout(), EnterAlternateScreen, cursor::Hide)?;
        Ok(guard)
    }
}

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        restore_terminal();
    }
}

/// Runs `rankgate top` until `q`, Ctrl-C, SIGTERM or SIGHUP (the SSH session went away).
/// `ca_file`: the CA an `https://` admin listener's certificate is checked against (else the
/// system's roots).
pub async fn run(
    admin: &str,
    interval: Duration,
    ca_file: Option<&std::path::Path>,
) -> Result<(), TopError> {
    let tls = rankgate::tls::Upstream::trusting(ca_file).map_err(|e| TopError::Admin {
        url: admin.to_string(),
        problem: e.to_string(),
    })?;
    let mut top = Top::with_tls(admin, interval, &tls)?;
    // Keys are read from stdin and frames drawn to stdout: both must be the terminal.
    if !io::stdout().is_terminal() || !io::stdin().is_terminal() {
        return Err(TopError::NotATerminal);
    }
    let mut signals = Signals::new()?;
    let guard = TerminalGuard::take()?;
    let mut terminal = Terminal::new(CrosstermBackend::new(io::stdout()))?;
    terminal.clear()?;

    // Keys come from a thread: crossterm's reads block. It stops when told, or when the loop
    // has gone (its channel closed), within one INPUT_POLL.
    let stop = Arc::new(AtomicBool::new(false));
    let (keys_tx, mut keys) = mpsc::channel::<io::Result<Event>>(64);
    let input = {
        let stop = stop.clone();
        std::thread::spawn(move || read_input(&keys_tx, &stop))
    };
    // Polls come from a task, so a slow admin listener never holds up a key. One poll at a
    // time; ticks missed while one runs are not made up.
    let (polls_tx, mut polls) = mpsc::channel::<Fetched>(1);
    let fetcher = top.fetcher.clone();
    let poller = tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if polls_tx.send(fetcher.fetch().await).await.is_err() {
                break;
            }
        }
    });

    let result = async {
        loop {
            render(top.state(), &mut terminal)?;
            tokio::select! {
                fetched = polls.recv() => match fetched {
                    Some(f) => top.apply(f),
                    None => return Ok(()),
                },
                event = keys.recv() => match event {
                    Some(Ok(Event::Key(key))) => {
                        let page = view::rows_on_screen(terminal.size()?.height);
                        if handle_key(top.state_mut(), key, page) == Action::Quit {
                            return Ok(());
                        }
                    }
                    // A resize, a mouse event: the next draw fits the new size.
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(TopError::Terminal(e)),
                    None => return Ok(()),
                },
                _ = signals.any() => return Ok(()),
            }
        }
    }
    .await;

    stop.store(true, Ordering::SeqCst);
    poller.abort();
    drop(keys);
    // Within one INPUT_POLL, joined so that nothing reads the terminal once it is given back.
    // But when the terminal itself went away (a dropped SSH session closes the pty), crossterm's
    // poll spins on the dead descriptor and never returns: then the thread is left behind, and
    // ends with the process, which is about to exit, instead of holding it up forever.
    let deadline = std::time::Instant::now() + 5 * INPUT_POLL;
    while !input.is_finished() && std::time::Instant::now() < deadline {
        std::thread::sleep(INPUT_POLL / 10);
    }
    if input.is_finished() {
        let _ = input.join();
    }
    // Dropping the terminal shows the cursor and prints a failure to stderr with eprintln!,
    // which panics when stderr was the terminal that went away: then there is no cursor to
    // show, and the terminal is let go without it.
    match terminal.show_cursor() {
        Ok(()) => drop(terminal),
        Err(_) => std::mem::forget(terminal),
    }
    drop(guard);
    result
}

/// Sends terminal events until `stop` is set or the receiver is gone.
fn read_input(tx: &mpsc::Sender<io::Result<Event>>, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) && !tx.is_closed() {
        let event = match event::poll(INPUT_POLL) {
            Ok(false) => continue,
            Ok(true) => event::read(),
            Err(e) => Err(e),
        };
        let failed = event.is_err();
        if tx.blocking_send(event).is_err() || failed {
            return;
        }
    }
}

/// The signals that end `top` while the terminal is raw (Ctrl-C then arrives as a key, but
/// `kill -INT` still comes as a signal).
struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> io::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    async fn any(&mut self) {
        tokio::select! {
            _ = self.int.recv() => {}
            _ = self.term.recv() => {}
            _ = self.hup.recv() => {}
        }
    }
}

#[cfg(test)]
mod tests;
