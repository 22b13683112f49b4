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
use super::flow::who::KeyBinding;
use super::layer::{Below, Step};
use crate::config::{FlowConfig, ServerConfig};

/// The number (from 1) of the line holding the `n`th key (from 0) of a key file's `text`.
fn key_line(text: &str, n: usize) -> usize {
    let keyed = |l: &&str| {
        l.split_ascii_whitespace()
            .next()
            .is_some_and(|k| !k.starts_with('#'))
    };
    (text.lines().enumerate())
        .filter(|(_, l)| keyed(l))
        .nth(n)
        .map_or(0, |(i, _)| i + 1)
}

/// The accepted keys, each with what it binds its requests to (flow control's tenant and
/// highest objective: `server.api_keys_file` lines `<key> tenant=<id> objective=<name>`).
pub struct Keys(Vec<Bound>);

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
    #[error("server.api_keys_file: {} line {line}: objective {name:?} is not one of flow.objectives", .path.display())]
    UnknownObjective {
        path: PathBuf,
        line: usize,
        name: String,
    },
}

/// What follows a key on its line: `tenant=<id>`, `objective=<name>`.
const BAD_BINDING: &str = "after the key, only `tenant=<id>` and `objective=<name>` may follow (letters, digits and -_.:@/+=, at most 128 bytes)";

fn binding(
    words: std::str::SplitAsciiWhitespace<'_>,
) -> Result<Option<Arc<KeyBinding>>, &'static str> {
    let mut b = KeyBinding::default();
    let ok = |v: &str| {
        !v.is_empty()
            && v.len() <= crate::config::MAX_TENANT_BYTES
            && v.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"-_.:@/+=".contains(&c))
    };
    for word in words {
        match word.split_once('=') {
            Some(("tenant", v)) if ok(v) && b.tenant.is_none() => b.tenant = Some(v.into()),
            Some(("objective", v)) if ok(v) && b.objective.is_none() => {
                b.objective = Some(v.into())
            }
            _ => return Err(BAD_BINDING),
        }
    }
    Ok((b != KeyBinding::default()).then(|| Arc::new(b)))
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
pub fn keys_from_env(var: &str, value: Option<OsString>) -> Result<Vec<Bound>, KeysError> {
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
        keys.push((k.as_bytes().into(), None));
    }
    if keys.is_empty() {
        return Err(KeysError::EnvEmpty { var: var.into() });
    }
    Ok(keys)
}

/// A key and what it binds its requests to.
pub type Bound = (Box<[u8]>, Option<Arc<KeyBinding>>);

/// The keys in a key file's text: one per line, trimmed, optionally followed by what it binds
/// its requests to (`tenant=<id> objective=<name>`); blank lines and lines starting with `#`
/// skipped. Only whole-line comments: a `#` inside a key is part of it.
pub fn keys_from_file(path: &Path, text: &str) -> Result<Vec<Bound>, KeysError> {
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let mut words = line.split_ascii_whitespace();
        let Some(k) = words.next().filter(|k| !k.starts_with('#')) else {
            continue;
        };
        let bad = |problem| KeysError::FileBadKey {
            path: path.into(),
            line: i + 1,
            problem,
        };
        check_key(k).map_err(bad)?;
        keys.push((k.as_bytes().into(), binding(words).map_err(bad)?));
    }
    if keys.is_empty() {
        return Err(KeysError::FileEmpty { path: path.into() });
    }
    Ok(keys)
}

impl Keys {
    /// Reads the keys `[server]` points at: `None` when it names no source. Both sources may be
    /// set; then either's keys are accepted.
    pub fn load(server: &ServerConfig, flow: &FlowConfig) -> Result<Option<Keys>, KeysError> {
        let mut keys = Vec::new();
        if let Some(var) = &server.api_keys_env {
            keys.extend(keys_from_env(var, std::env::var_os(var))?);
        }
        if let Some(path) = &server.api_keys_file {
            let text = std::fs::read_to_string(path).map_err(|source| KeysError::FileRead {
                path: path.clone(),
                source,
            })?;
            let bound = keys_from_file(path, &text)?;
            // The objectives the keys name are flow's: a misspelt one is said at startup.
            let named = |b: &Option<Arc<KeyBinding>>| b.as_ref()?.objective.clone();
            for (line, (_, b)) in bound.iter().enumerate() {
                match named(b) {
                    Some(name) if flow.objective(&name).is_none() => {
                        return Err(KeysError::UnknownObjective {
                            path: path.clone(),
                            // Lines without a key are not counted here: found again below.
                            line: key_line(&text, line),
                            name: name.to_string(),
                        });
                    }
                    _ => {}
                }
            }
            keys.extend(bound);
        }
        Ok((!keys.is_empty()).then_some(Keys(keys)))
    }

    /// One accepted key (the admin token).
    pub fn single(key: &[u8]) -> Keys {
        Keys(vec![(key.into(), None)])
    }

    #[cfg(test)]
    pub fn new(keys: &[&str]) -> Keys {
        Keys(keys.iter().map(|k| (k.as_bytes().into(), None)).collect())
    }

    /// Whether `presented` is one of the keys.
    pub fn accepts(&self, presented: &[u8]) -> bool {
        self.matched(presented).is_some()
    }

    /// Which key `presented` is. Every key is compared, each over the whole of the longer of
    /// the two, and the results are folded without a branch: the time taken depends on the
    /// keys' lengths and the one presented, never on which key matched or how much of it.
    fn matched(&self, presented: &[u8]) -> Option<usize> {
        // 1 + the index of the last key that matched, 0 for none.
        let mut found = 0usize;
        for (i, (k, _)) in self.0.iter().enumerate() {
            let eq = constant_time_eq(k, presented) as usize;
            found = found * (1 - eq) + (i + 1) * eq;
        }
        found.checked_sub(1)
    }

    /// Checks a request's `Authorization` header; what its key binds it to, if anything.
    pub fn check(&self, h: &http::HeaderMap) -> Result<Option<Arc<KeyBinding>>, Denied> {
        let v = h.get(header::AUTHORIZATION).ok_or(Denied::Missing)?;
        let token = bearer_token(v.as_bytes()).ok_or(Denied::NotBearer)?;
        match self.matched(token) {
            Some(i) => Ok(self.0[i].1.clone()),
            None => Err(Denied::Wrong),
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
        match gate.keys.as_ref().map(|k| k.check(req.headers())) {
            Some(Err(d)) => return Step::ready(Err(ProxyError::Unauthorized(d))),
            Some(Ok(Some(binding))) => {
                req.extensions_mut().insert(binding);
            }
            _ => {}
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

    fn strs(keys: Vec<Bound>) -> Vec<String> {
        keys.iter()
            .map(|(k, _)| String::from_utf8_lossy(k).into_owned())
            .collect()
    }

    #[test]
    fn file_keys_may_bind_a_tenant_and_an_objective() {
        let text = "sk-a tenant=acme objective=standard\nsk-b\nsk-c objective=batch\n";
        let keys = keys_from_file(Path::new("/k"), text).unwrap();
        let b = keys[0].1.as_deref().unwrap();
        assert_eq!(b.tenant.as_deref(), Some("acme"));
        assert_eq!(b.objective.as_deref(), Some("standard"));
        assert!(keys[1].1.is_none());
        let keys = Keys(keys);
        let h = |k: &str| {
            let mut h = HeaderMap::new();
            h.insert(
                header::AUTHORIZATION,
                format!("Bearer {k}").parse().unwrap(),
            );
            h
        };
        let bound = keys.check(&h("sk-c")).unwrap().unwrap();
        assert_eq!(bound.objective.as_deref(), Some("batch"));
        assert!(keys.check(&h("sk-b")).unwrap().is_none());
        assert_eq!(keys.check(&h("sk-d")).unwrap_err(), Denied::Wrong);
        for bad in [
            "k tenant=",
            "k colour=red",
            "k tenant=a tenant=b",
            "k tenant=a\"b",
        ] {
            let e = keys_from_file(Path::new("/k"), bad)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("line 1") && e.contains("tenant=<id>"),
                "{bad}: {e}"
            );
        }
        assert_eq!(key_line("# c\n\nk1\n# d\nk2 x=y\n", 1), 5);
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
        assert_eq!(check(Some("Bearer k1")), Ok(None));
        assert_eq!(check(Some("bearer   k1")), Ok(None));
    }

    #[test]
    fn debug_shows_the_count_only() {
        let d = format!("{:?}", Keys::new(&["sk-secret", "other"]));
        assert_eq!(d, "Keys(2 accepted)");
    }
}
