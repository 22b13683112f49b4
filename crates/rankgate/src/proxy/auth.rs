//! Inbound API keys: a request must carry `Authorization: Bearer <key>` with one of the keys
//! rankgate was started with, or it gets 401 before anything else looks at it.
//!
//! The layer sits right below `respond`, above `route`: an unknown path without a key is a 401
//! too, so the route table is not visible to whoever has no key. Keys are read once, at startup
//! ([`Keys::load`], from `server.api_keys_env` and/or `server.api_keys_file`); a missing or
//! empty source stops the start rather than leaving the door open. Without either setting the
//! layer holds nothing and passes every request straight through.
//!
//! Keys never reach a log: [`Keys`]' `Debug` prints how many there are, errors name the
//! variable or the file and the line, never a value. The comparison takes the same time whichever
//! key matched, or none (see [`Keys::accepts`]).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use http::{header, Request};

use std::sync::Arc;

use http::HeaderMap;

use super::error::{DebugRefused, Denied, ProxyError};
use super::layer::{Below, Step};
use crate::config::ServerConfig;

/// The accepted keys.
pub struct Keys(Vec<Box<[u8]>>);

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Keys({} accepted)", self.0.len())
    }
}

/// Why the keys could not be loaded. Names where they were looked for, never a key.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error("server.api_keys_env: environment variable {var} is not set")]
    EnvUnset { var: String },
    #[error("server.api_keys_env: environment variable {var} is not valid UTF-8")]
    EnvNotUnicode { var: String },
    #[error("server.api_keys_env: environment variable {var} holds no key (expected comma-separated keys)")]
    EnvEmpty { var: String },
    #[error("server.api_keys_env: environment variable {var}, entry {entry}: {problem}")]
    EnvBadKey {
        var: String,
        entry: usize,
        problem: &'static str,
    },
    #[error("server.api_keys_file: cannot read {}: {source}", .path.display())]
    FileRead {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("server.api_keys_file: {} holds no key (one key per line; blank lines and lines starting with # are skipped)", .path.display())]
    FileEmpty { path: PathBuf },
    #[error("server.api_keys_file: {} line {line}: {problem}", .path.display())]
    FileBadKey {
        path: PathBuf,
        line: usize,
        problem: &'static str,
    },
}

/// What no `Authorization: Bearer` value can carry, so a key holding it could never match: the
/// file is wrong, and it is better said at startup than by every request being refused.
const BAD_KEY: &str = "a key must be printable ASCII without spaces";

fn check_key(k: &str) -> Result<(), &'static str> {
    if k.bytes().all(|b| b.is_ascii_graphic()) {
        Ok(())
    } else {
        Err(BAD_KEY)
    }
}

/// The keys in an environment variable's value: comma-separated, each trimmed, empty entries
/// skipped. `value` is what the environment held (`None`: unset), so this is testable without
/// touching the process environment.
pub fn keys_from_env(var: &str, value: Option<OsString>) -> Result<Vec<Box<[u8]>>, KeysError> {
    let value = value.ok_or_else(|| KeysError::EnvUnset { var: var.into() })?;
    let text = value
        .to_str()
        .ok_or_else(|| KeysError::EnvNotUnicode { var: var.into() })?;
    let mut keys = Vec::new();
    for (i, k) in text.split(',').map(str::trim).enumerate() {
        if k.is_empty() {
            continue;
        }
        check_key(k).map_err(|problem| KeysError::EnvBadKey {
            var: var.into(),
            entry: i + 1,
            problem,
        })?;
        keys.push(k.as_bytes().into());
    }
    if keys.is_empty() {
        return Err(KeysError::EnvEmpty { var: var.into() });
    }
    Ok(keys)
}

/// The keys in a key file's text: one per line, trimmed; blank lines and lines starting with
/// `#` skipped. Only whole-line comments: a `#` inside a key is part of it.
pub fn keys_from_file(path: &Path, text: &str) -> Result<Vec<Box<[u8]>>, KeysError> {
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let k = line.trim();
        if k.is_empty() || k.starts_with('#') {
            continue;
        }
        check_key(k).map_err(|problem| KeysError::FileBadKey {
            path: path.into(),
            line: i + 1,
            problem,
        })?;
        keys.push(k.as_bytes().into());
    }
    if keys.is_empty() {
        return Err(KeysError::FileEmpty { path: path.into() });
    }
    Ok(keys)
}

impl Keys {
    /// Reads the keys `[server]` points at: `None` when it names no source. Both sources may be
    /// set; then either's keys are accepted.
    pub fn load(server: &ServerConfig) -> Result<Option<Keys>, KeysError> {
        let mut keys = Vec::new();
        if let Some(var) = &server.api_keys_env {
            keys.extend(keys_from_env(var, std::env::var_os(var))?);
        }
        if let Some(path) = &server.api_keys_file {
            let text = std::fs::read_to_string(path).map_err(|source| KeysError::FileRead {
                path: path.clone(),
                source,
            })?;
            keys.extend(keys_from_file(path, &text)?);
        }
        Ok((!keys.is_empty()).then_some(Keys(keys)))
    }

    /// One accepted key (the admin token).
    pub fn single(key: &[u8]) -> Keys {
        Keys(vec![key.into()])
    }

    #[cfg(test)]
    pub fn new(keys: &[&str]) -> Keys {
        Keys(keys.iter().map(|k| k.as_bytes().into()).collect())
    }

    /// Whether `presented` is one of the keys. Every key is compared, each over the whole of the
    /// longer of the two, and the results are folded without a branch: the time taken depends on
    /// the keys' lengths and the one presented, never on which key matched or how much of it.
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let mut ok = false;
        for k in &self.0 {
            ok |= constant_time_eq(k, presented);
        }
        ok
    }

    /// Checks a request's `Authorization` header.
    pub fn check(&self, h: &http::HeaderMap) -> Result<(), Denied> {
        let v = h.get(header::AUTHORIZATION).ok_or(Denied::Missing)?;
        let token = bearer_token(v.as_bytes()).ok_or(Denied::NotBearer)?;
        if self.accepts(token) {
            Ok(())
        } else {
            Err(Denied::Wrong)
        }
    }
}

/// The token of a `Bearer <token>` value (the scheme is case-insensitive, RFC 7235).
fn bearer_token(v: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer ";
    if v.len() <= SCHEME.len() || !v[..SCHEME.len()].eq_ignore_ascii_case(SCHEME) {
        return None;
    }
    let token = v[SCHEME.len()..].trim_ascii_start();
    (!token.is_empty()).then_some(token)
}

/// Equality that reads both inputs to the end of the longer one, whatever it finds: the lengths
/// differing only sets a bit in the same accumulator, never ends the loop early.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= usize::from(x ^ y);
    }
    // Kept opaque so the compiler cannot turn the fold back into an early exit.
    std::hint::black_box(diff) == 0
}

/// The layer. Without keys a request costs a `match` and a header lookup here (for
/// `x-rankgate-debug`, whose admin token is checked here too).
#[derive(Clone)]
pub struct Auth<S> {
    inner: S,
    gate: Arc<Gate>,
}

/// What a request must show: a client key (when keys are set), and the admin token to ask for
/// debugging.
#[derive(Debug)]
pub struct Gate {
    /// The accepted client keys; `None`: no key is asked for.
    pub keys: Option<Keys>,
    /// The admin token, which `x-rankgate-debug` needs; `None`: debugging is off.
    pub debug_token: Option<Keys>,
}

impl<S> Auth<S> {
    pub fn new(inner: S, gate: &Arc<Gate>) -> Auth<S> {
        Auth {
            inner,
            gate: gate.clone(),
        }
    }
}

/// Whether the request asks for debugging, and if so whether it may: `None` when it does not
/// ask, `Some(Ok)` when it asks with the admin token (for `auth`).
fn debug_allowed(token: Option<&Keys>, h: &HeaderMap) -> Option<Result<(), DebugRefused>> {
    let asked = h.get(&super::trace::DEBUG)?;
    Some((|| {
        if asked.as_bytes() != b"1" {
            return Err(DebugRefused::NotOne);
        }
        let token = token.ok_or(DebugRefused::Off)?;
        let sent = h
            .get(&super::trace::ADMIN_TOKEN)
            .ok_or(DebugRefused::Missing)?;
        match token.accepts(sent.as_bytes()) {
            true => Ok(()),
            false => Err(DebugRefused::Wrong),
        }
    })())
}

impl<S, B> tower::Service<Request<B>> for Auth<S>
where
    S: Below<B>,
{
    layer_types!(Step<S::Future>);

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        let gate = &*self.gate;
        if let Some(Err(d)) = gate.keys.as_ref().map(|k| k.check(req.headers())) {
            return Step::ready(Err(ProxyError::Unauthorized(d)));
        }
        if let Some(Err(refused)) = debug_allowed(gate.debug_token.as_ref(), req.headers()) {
            return Step::ready(Err(refused.into()));
        }
        // The debugging headers are rankgate's alone, the admin token above all: consumed
        // here, so no path below (proxied, retried, or a gRPC call rankgate makes itself)
        // can pass them on to an engine.
        let h = req.headers_mut();
        if h.contains_key(&super::trace::ADMIN_TOKEN) || h.contains_key(&super::trace::DEBUG) {
            h.remove(&super::trace::ADMIN_TOKEN);
            h.remove(&super::trace::DEBUG);
        }
        Step::Below(self.inner.call(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strs(keys: Vec<Box<[u8]>>) -> Vec<String> {
        keys.iter()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect()
    }

    #[test]
    fn env_keys_are_comma_separated_trimmed_and_empty_entries_skipped() {
        let keys = keys_from_env("K", Some(" a1, ,b2 ,,c3".into())).unwrap();
        assert_eq!(strs(keys), ["a1", "b2", "c3"]);
    }

    #[test]
    fn env_errors_name_the_variable_never_a_key() {
        let e = keys_from_env("MY_KEYS", None).unwrap_err().to_string();
        assert!(e.contains("MY_KEYS") && e.contains("not set"), "{e}");
        let e = keys_from_env("MY_KEYS", Some(" , ".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("MY_KEYS") && e.contains("no key"), "{e}");
        let e = keys_from_env("MY_KEYS", Some("good,sec ret".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("entry 2") && !e.contains("sec"), "{e}");
    }

    #[test]
    fn file_keys_skip_comments_and_blank_lines() {
        let text = "# team keys\n\nsk-one\n  sk-two  \r\n   # indented comment\nsk-#three\n";
        let keys = keys_from_file(Path::new("/k"), text).unwrap();
        assert_eq!(strs(keys), ["sk-one", "sk-two", "sk-#three"]);
    }

    #[test]
    fn file_errors_name_the_file_and_line_never_a_key() {
        let e = keys_from_file(Path::new("/etc/keys"), "# only\n\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("/etc/keys") && e.contains("no key"), "{e}");
        let e = keys_from_file(Path::new("/etc/keys"), "ok\nhalf key\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2") && !e.contains("half"), "{e}");
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"", b""));
        assert!(constant_time_eq(b"sk-abc", b"sk-abc"));
        assert!(!constant_time_eq(b"sk-abc", b"sk-abd"));
        assert!(!constant_time_eq(b"sk-abc", b"sk-ab"));
        assert!(!constant_time_eq(b"sk-ab", b"sk-abc"));
        // A prefix padded with what the shorter side reads as (0) is still not equal.
        assert!(!constant_time_eq(b"ab\0", b"ab"));
        assert!(!constant_time_eq(b"", b"\0"));
    }

    #[test]
    fn any_key_is_accepted_and_nothing_else() {
        let keys = Keys::new(&["first", "second-longer"]);
        assert!(keys.accepts(b"first"));
        assert!(keys.accepts(b"second-longer"));
        assert!(!keys.accepts(b"second"));
        assert!(!keys.accepts(b""));
    }

    #[test]
    fn bearer_header_parsing() {
        let keys = Keys::new(&["k1"]);
        let check = |v: Option<&str>| {
            let mut h = http::HeaderMap::new();
            if let Some(v) = v {
                h.insert(header::AUTHORIZATION, v.parse().unwrap());
            }
            keys.check(&h)
        };
        assert_eq!(check(None), Err(Denied::Missing));
        assert_eq!(check(Some("Basic azE=")), Err(Denied::NotBearer));
        assert_eq!(check(Some("Bearer")), Err(Denied::NotBearer));
        assert_eq!(check(Some("Bearer k2")), Err(Denied::Wrong));
        assert_eq!(check(Some("Bearer k1")), Ok(()));
        assert_eq!(check(Some("bearer   k1")), Ok(()));
    }

    #[test]
    fn debug_shows_the_count_only() {
        let d = format!("{:?}", Keys::new(&["sk-secret", "other"]));
        assert_eq!(d, "Keys(2 accepted)");
    }
}
