//! A config file's TOML error as rankgate says it: the file, line, column and the key the line
//! sets, and the problem, never the file's own text. The start, `rankgate check`, SIGHUP and
//! `POST /reload` all say it this way (`whole.rs`).

/// "line N, column C, key `k`: message": where in the file, and what is wrong, never the
/// file's own text. A path pointed at the wrong file (`/proc/self/environ`, a `.env`, a key
/// file) must not have its bytes echoed into a reload's 400 answer and the log, so the line is
/// not quoted and what toml's message quotes of the file (a value) is left out ([`redact`]).
/// The key the line sets is named when it is a plain key (letters, digits, `_`, `-`, `.`, at
/// most 64): a name, which is what says where the problem is, never a value.
pub(super) fn describe(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else {
        return redact(e.message(), text, None);
    };
    let start = floor_char_boundary(text, span.start.min(text.len()));
    let before = &text[..start];
    let line_no = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    let line = text[line_start..].split('\n').next().unwrap_or("");
    let key = line
        .split_once('=')
        .map(|(k, _)| k.trim())
        .filter(|k| plain_key(k));
    let message = redact(e.message(), text, key);
    match key {
        Some(k) => format!("line {line_no}, column {column}, key `{k}`: {message}"),
        None => format!("line {line_no}, column {column}: {message}"),
    }
}

/// A key as a config writes one: a few letters, digits, `_`, `-` and `.`.
fn plain_key(k: &str) -> bool {
    (1..=64).contains(&k.len())
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// The longest message given, once redacted.
const MAX_PARSE_MESSAGE: usize = 300;

/// `message` without the file's text: each segment it quotes (between backticks or double
/// quotes) that the file holds, or that is escaped (a value re-rendered with `\`), becomes `…`,
/// but for the line's own `key`. What it quotes of rankgate's own (the keys and values it
/// expects) stays.
fn redact(message: &str, text: &str, key: Option<&str>) -> String {
    // One line: toml writes "invalid string\nexpected ...".
    let message = message.trim().replace('\n', ", ");
    // serde's and toml's "..., expected X": X is what rankgate expects (its keys, its values),
    // never the file's.
    let (said, expected) = match message.find(", expected ") {
        Some(i) => message.split_at(i),
        None => (message.as_str(), ""),
    };
    let mut out = redact_quoted(said, text, key);
    if out.len() > MAX_PARSE_MESSAGE {
        let cut = floor_char_boundary(&out, MAX_PARSE_MESSAGE);
        out.truncate(cut);
        out.push('…');
    }
    out.push_str(expected);
    out
}

/// `message` with each quoted segment that `text` holds (or that is escaped) as `…`, but `key`.
fn redact_quoted(message: &str, text: &str, key: Option<&str>) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(open) = rest.find(['`', '"']) {
        let quote = rest.as_bytes()[open];
        out.push_str(&rest[..=open]);
        let after = &rest[open + 1..];
        // The closing quote: a double quote escaped with a backslash is inside.
        let mut close = None;
        let mut escaped = false;
        for (i, b) in after.bytes().enumerate() {
            match b {
                b'\\' if quote == b'"' => escaped = !escaped,
                b if b == quote && !escaped => {
                    close = Some(i);
                    break;
                }
                _ => escaped = false,
            }
        }
        let Some(close) = close else {
            out.push('…');
            rest = "";
            break;
        };
        let inner = &after[..close];
        let file_text = text.contains(inner) || inner.contains('\\');
        match !inner.is_empty() && Some(inner) != key && file_text {
            true => out.push('…'),
            false => out.push_str(inner),
        }
        out.push(quote as char);
        rest = &after[close + 1..];
    }
    out.push_str(rest);
    out
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_parse_error_names_the_line_never_the_files_text() {
        // What a path pointed at the environment (`/proc/self/environ`) or a `.env` reads as.
        for text in [
            "HOME=/root\0RANKGATE_ADMIN_TOKEN=s3cr3t-t0ken-value\0PATH=/bin\0",
            "# env\nRANKGATE_ADMIN_TOKEN = \"s3cr3t-t0ken-value\"\n",
            "[server]\nmax_in_flight = \"s3cr3t-t0ken-value\"\n",
            "[telemetry]\ninterval = \"s3cr3t-t0ken-value\"\n",
            "[telemetry]\ninterval = \"s3cr3t\\\"t0ken\"\n",
            "[[engines]]\nurl = \"http://a:1\"\nflavor = \"s3cr3t-t0ken-value\"\n",
            "x = [\"s3cr3t-t0ken-value\" \"b\"]\n",
        ] {
            let e = super::super::Config::from_str(text)
                .unwrap_err()
                .to_string();
            assert!(e.contains("line "), "{e}");
            // Key names may be named (they say where); values never.
            for part in ["s3cr3t", "t0ken", "/root", "/bin"] {
                assert!(!e.contains(part), "{part} in {e:?}");
            }
        }
        let e = super::super::Config::from_str("[server]\n\n  listen = 5\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 3, column 12, key `listen`: invalid type: integer `…`"),
            "{e}"
        );
    }
}
