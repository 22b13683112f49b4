//! Reading one field of a request body without parsing the whole of it: a JSON object's
//! top-level string member (`model`), or a multipart form's field. The body stays the client's
//! bytes; the scan stops at the member it looks for, skipping the values before it (a long
//! prompt is stepped over, never built into a tree).

use std::borrow::Cow;

/// Why a body could not be scanned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScanError {
    #[error("request body is not a JSON object")]
    NotObject,
    #[error("request body is not valid JSON (at byte {0})")]
    Invalid(usize),
    #[error("`{0}` must be a string")]
    NotString(String),
    #[error("request body is not a multipart/form-data form with a boundary")]
    NotForm,
}

/// The value of the top-level member `key` of the JSON object in `body`, when it is there.
/// Other members' values are stepped over, not validated in depth. When `key` appears twice the
/// last one counts, as in the engines' JSON parsers: the scan reads the object's top level to
/// its end, so a request cannot be routed by one `model` and served by another.
pub fn json_member<'a>(body: &'a [u8], key: &str) -> Result<Option<Cow<'a, str>>, ScanError> {
    // A later occurrence replaces an earlier one, a wrong type included.
    let mut found = Ok(None);
    members(body, |name, s| {
        if name != key {
            return s.skip_value();
        }
        found = match s.peek() {
            Some(b'"') => Ok(Some(s.string()?)),
            _ => {
                let null = s.b[s.i..].starts_with(b"null");
                s.skip_value()?;
                match null {
                    true => Ok(None),
                    false => Err(ScanError::NotString(key.to_string())),
                }
            }
        };
        Ok(())
    })?;
    found
}

/// The top-level string member `key` of the JSON object in `body` when none names `value`: a
/// one-model fleet's check, stopping at the first that does (a later one naming another is the
/// engine's to refuse). `None` too without one, or for a body not a JSON object.
pub fn json_member_other<'a>(body: &'a [u8], key: &str, value: &str) -> Option<Cow<'a, str>> {
    let mut s = Scanner { b: body, i: 0 };
    let mut other = None;
    s.ws();
    s.expect(b'{').ok()?;
    loop {
        s.ws();
        if s.peek() == Some(b'}') {
            return other;
        }
        let name = s.string().ok()?;
        s.ws();
        s.expect(b':').ok()?;
        s.ws();
        match name == key && s.peek() == Some(b'"') {
            true => match s.string().ok()? {
                v if v == value => return None,
                v => other = Some(v),
            },
            false => s.skip_value().ok()?,
        }
        s.ws();
        if s.peek() == Some(b',') {
            s.i += 1;
        }
    }
}

/// The raw bytes of the value of the first of `keys` the object has as a top-level member (its
/// last occurrence), as the client wrote them: for hashing, not reading. One pass over the
/// body whatever the number of keys.
pub fn json_member_raw<'a>(body: &'a [u8], keys: &[&str]) -> Result<Option<&'a [u8]>, ScanError> {
    // The most preferred key seen so far (its index in `keys`) and its value.
    let mut found: Option<(usize, &'a [u8])> = None;
    members(body, |name, s| {
        let start = s.i;
        s.skip_value()?;
        if let Some(k) = keys.iter().position(|k| *k == name) {
            if found.is_none_or(|(best, _)| k <= best) {
                found = Some((k, &s.b[start..s.i]));
            }
        }
        Ok(())
    })?;
    Ok(found.map(|(_, v)| v))
}

/// Copies the top-level members of the JSON object in `body` into `out` as the client wrote
/// them (`"name":value`, each followed by a comma), leaving out those named in `drop`. Only for
/// a body already known to be valid JSON: values are stepped over, not validated.
pub fn copy_members_except(body: &[u8], drop: &[&str], out: &mut Vec<u8>) -> Result<(), ScanError> {
    members_at(body, |start, name, s| {
        s.skip_value()?;
        if !drop.contains(&name) {
            out.extend_from_slice(&s.b[start..s.i]);
            out.push(b',');
        }
        Ok(())
    })
}

/// Walks the top level of the JSON object in `body`: `visit` gets each member's name with the
/// scanner at its value, and must step over the value.
fn members<'a>(
    body: &'a [u8],
    mut visit: impl FnMut(&str, &mut Scanner<'a>) -> Result<(), ScanError>,
) -> Result<(), ScanError> {
    members_at(body, |_, name, s| visit(name, s))
}

/// [`members`], also telling where each member's name begins.
fn members_at<'a>(
    body: &'a [u8],
    mut visit: impl FnMut(usize, &str, &mut Scanner<'a>) -> Result<(), ScanError>,
) -> Result<(), ScanError> {
    let mut s = Scanner { b: body, i: 0 };
    s.ws();
    if s.peek() != Some(b'{') {
        return Err(if s.peek().is_none() {
            ScanError::Invalid(s.i)
        } else {
            ScanError::NotObject
        });
    }
    s.i += 1;
    s.ws();
    if s.peek() == Some(b'}') {
        return Ok(());
    }
    loop {
        s.ws();
        let start = s.i;
        let name = s.string()?;
        s.ws();
        s.expect(b':')?;
        s.ws();
        visit(start, &name, &mut s)?;
        s.ws();
        match s.peek() {
            Some(b',') => s.i += 1,
            Some(b'}') => return Ok(()),
            _ => return Err(ScanError::Invalid(s.i)),
        }
    }
}

struct Scanner<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn expect(&mut self, c: u8) -> Result<(), ScanError> {
        if self.peek() != Some(c) {
            return Err(ScanError::Invalid(self.i));
        }
        self.i += 1;
        Ok(())
    }

    /// A string at the cursor, unescaped only when it has escapes.
    fn string(&mut self) -> Result<Cow<'a, str>, ScanError> {
        let start = self.i;
        self.expect(b'"')?;
        let from = self.i;
        let mut escaped = false;
        loop {
            match self.peek() {
                None => return Err(ScanError::Invalid(self.i)),
                Some(b'"') => break,
                Some(b'\\') => {
                    escaped = true;
                    self.i += 2;
                }
                Some(c) if c < 0x20 => return Err(ScanError::Invalid(self.i)),
                Some(_) => self.i += 1,
            }
        }
        let raw = self.b.get(from..self.i).ok_or(ScanError::Invalid(self.i))?;
        self.i += 1;
        if !escaped {
            return std::str::from_utf8(raw)
                .map(Cow::Borrowed)
                .map_err(|_| ScanError::Invalid(from));
        }
        // Rare: let the JSON parser unescape it.
        serde_json::from_slice::<String>(&self.b[start..self.i])
            .map(Cow::Owned)
            .map_err(|_| ScanError::Invalid(start))
    }

    /// Steps over one value: strings skipped whole, so brackets inside them do not count.
    fn skip_value(&mut self) -> Result<(), ScanError> {
        match self.peek() {
            None => Err(ScanError::Invalid(self.i)),
            Some(b'"') => self.string().map(drop),
            Some(b'{' | b'[') => {
                let mut depth = 0usize;
                loop {
                    match self.peek() {
                        None => return Err(ScanError::Invalid(self.i)),
                        Some(b'"') => {
                            self.string()?;
                        }
                        Some(b'{' | b'[') => {
                            depth += 1;
                            self.i += 1;
                        }
                        Some(b'}' | b']') => {
                            depth -= 1;
                            self.i += 1;
                            if depth == 0 {
                                return Ok(());
                            }
                        }
                        Some(_) => self.i += 1,
                    }
                }
            }
            Some(_) => {
                // A number or a literal: up to the separator.
                let start = self.i;
                while let Some(c) = self.peek() {
                    if matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                        break;
                    }
                    self.i += 1;
                }
                if self.i == start {
                    Err(ScanError::Invalid(start))
                } else {
                    Ok(())
                }
            }
        }
    }
}

/// The value of the form field `name` in a `multipart/form-data` body with `boundary`.
pub fn form_field<'a>(body: &'a [u8], boundary: &str, name: &str) -> Option<Cow<'a, str>> {
    let delimiter = format!("--{boundary}");
    let mut at = find(body, delimiter.as_bytes(), 0)?;
    // As for JSON, a field sent twice counts by its last value.
    let mut found = None;
    loop {
        let part = at + delimiter.len();
        // The closing delimiter ends the form.
        if body.get(part..part + 2) == Some(b"--") {
            return found;
        }
        let Some(head_end) = find(body, b"\r\n\r\n", part) else {
            return found;
        };
        let Some(next) = find(body, format!("\r\n{delimiter}").as_bytes(), head_end) else {
            return found;
        };
        let head = String::from_utf8_lossy(&body[part..head_end]);
        if head.lines().any(|line| field_name(line) == Some(name)) {
            // An empty part's delimiter may begin inside the blank line that ends its head.
            let value = body.get(head_end + 4..next).unwrap_or_default();
            found = std::str::from_utf8(value)
                .ok()
                .map(|v| Cow::Borrowed(v.trim()));
        }
        at = next + 2;
    }
}

/// The field name a part's `Content-Disposition: form-data; name="..."` line gives: the `name`
/// parameter itself, never `filename`.
fn field_name(line: &str) -> Option<&str> {
    let (header, value) = line.split_once(':')?;
    if !header.trim().eq_ignore_ascii_case("content-disposition") {
        return None;
    }
    value.split(';').skip(1).find_map(|param| {
        let (k, v) = param.split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case("name")
            .then(|| v.trim().trim_matches('"'))
    })
}

/// The boundary of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Option<&str> {
    let (kind, params) = content_type.split_once(';')?;
    if !kind.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    params.split(';').find_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim()
            .eq_ignore_ascii_case("boundary")
            .then(|| v.trim().trim_matches('"'))
            .filter(|b| !b.is_empty())
    })
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    let first = *needle.first()?;
    let mut i = from;
    while i + needle.len() <= hay.len() {
        let skip = hay[i..].iter().position(|&c| c == first)?;
        i += skip;
        if hay.get(i..i + needle.len())? == needle {
            return Some(i);
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    fn model(body: &str) -> Result<Option<String>, ScanError> {
        json_member(body.as_bytes(), "model").map(|m| m.map(Cow::into_owned))
    }

    #[test]
    fn finds_the_top_level_model_and_nothing_nested() {
        assert_eq!(model(r#"{"model":"a","x":1}"#), Ok(Some("a".into())));
        assert_eq!(
            model(
                r#" { "messages": [{"model": "inner", "content": "a \"}] model"}], "model" : "b" } "#
            ),
            Ok(Some("b".into()))
        );
        assert_eq!(model(r#"{"meta":{"model":"inner"}}"#), Ok(None));
        assert_eq!(
            model(r#"{"mod\u0065l":"esc\u00e9"}"#),
            Ok(Some("escé".into()))
        );
        assert_eq!(model(r#"{"model":null}"#), Ok(None));
        assert_eq!(model("{}"), Ok(None));
        assert_eq!(
            model(r#"{"model":7}"#),
            Err(ScanError::NotString("model".into()))
        );
        assert_eq!(
            model(r#"{"model":"a","x":[1],"model":"b"}"#),
            Ok(Some("b".into()))
        );
        assert_eq!(model(r#"{"model":7,"model":"b"}"#), Ok(Some("b".into())));
        assert_eq!(model("[1]"), Err(ScanError::NotObject));
        assert!(matches!(model(r#"{"a":"#), Err(ScanError::Invalid(_))));
        assert!(matches!(model(""), Err(ScanError::Invalid(_))));
        assert!(matches!(model(r#"{"a" 1}"#), Err(ScanError::Invalid(_))));
    }

    #[test]
    fn another_model_is_named_and_the_served_one_stops_the_scan() {
        // A later `m` is served, so is an escaped one; the rest is the engine's to refuse.
        for (body, want) in [
            (r#"{"model": "m", "messages": [1, {"a": "}"}]}"#, None),
            (
                r#"{"messages": [{"model": "m"}], "model": "gpt-4"}"#,
                Some("gpt-4"),
            ),
            (r#"{"model": "x", "model": "m"}"#, None),
            (r#"{"model": "\u006d"}"#, None),
            (r#"{"prompt": "model"}"#, None),
            (r#"{"model": 3}"#, None),
            (r#"{"model": "x", "#, None),
        ] {
            let got = json_member_other(body.as_bytes(), "model", "m");
            assert_eq!(got.as_deref(), want, "{body}");
        }
    }

    #[test]
    fn raw_values_by_preference_in_one_pass() {
        let raw = |b: &str, keys: &[&str]| {
            json_member_raw(b.as_bytes(), keys)
                .map(|v| v.map(|v| String::from_utf8_lossy(v).into_owned()))
        };
        let body = r#"{"prompt":"p","messages":[{"a":1}],"messages":[2]}"#;
        assert_eq!(raw(body, &["messages", "prompt"]), Ok(Some("[2]".into())));
        assert_eq!(raw(body, &["prompt", "messages"]), Ok(Some("\"p\"".into())));
        assert_eq!(
            raw(r#"{"prompt":["x", "y"]}"#, &["messages", "prompt"]),
            Ok(Some(r#"["x", "y"]"#.into()))
        );
        assert_eq!(raw(r#"{"input":1}"#, &["messages", "prompt"]), Ok(None));
        assert_eq!(raw("[1]", &["prompt"]), Err(ScanError::NotObject));
    }

    #[test]
    fn reads_a_multipart_form_field() {
        let body = "--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
                    Content-Type: audio/wav\r\n\r\nRIFF--XyZ-not-a-delimiter\r\n--XyZ\r\n\
                    Content-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n--XyZ--\r\n";
        let ct = "multipart/form-data; boundary=XyZ";
        let b = boundary(ct).unwrap();
        assert_eq!(
            form_field(body.as_bytes(), b, "model").as_deref(),
            Some("whisper-1")
        );
        assert_eq!(form_field(body.as_bytes(), b, "language"), None);
        // A file called "model" is not the model field; the last model field counts.
        let tricky = "--q\r\nContent-Disposition: form-data; name=\"file\"; filename=\"model\"\r\n\r\n\
                      x\r\n--q\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\na\r\n--q\r\n\
                      Content-Disposition: form-data; name=\"model\"\r\n\r\nc\r\n--q--\r\n";
        assert_eq!(
            form_field(tricky.as_bytes(), "q", "model").as_deref(),
            Some("c")
        );
        let empty = "--q\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n--q--\r\n";
        assert_eq!(
            form_field(empty.as_bytes(), "q", "model").as_deref(),
            Some("")
        );
        assert_eq!(boundary("multipart/form-data; boundary=\"q\""), Some("q"));
        assert_eq!(boundary("application/json"), None);
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            (-1e6f64..1e6).prop_map(|f| json!(f)),
            "[a-z\"\\\\{}\\[\\],:é ]{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-z\"]{0,6}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Whatever else the object holds, and however it is printed, the scan agrees with a
        /// full parse.
        #[test]
        fn agrees_with_a_full_parse(
            members in prop::collection::vec(("[a-z]{0,6}", json_value()), 0..5),
            model in proptest::option::of("[a-zA-Z0-9/._\"\\\\-]{0,16}"),
            at in 0usize..6,
            pretty in any::<bool>(),
        ) {
            let mut obj = serde_json::Map::new();
            for (i, (k, v)) in members.into_iter().enumerate() {
                if i == at {
                    if let Some(m) = &model { obj.insert("model".into(), json!(m)); }
                }
                if k != "model" { obj.insert(k, v); }
            }
            if let Some(m) = &model { obj.entry("model").or_insert(json!(m)); }
            let v = Value::Object(obj);
            let text = if pretty { serde_json::to_string_pretty(&v) } else { serde_json::to_string(&v) }.unwrap();
            let want = v.get("model").and_then(Value::as_str).map(str::to_string);
            prop_assert_eq!(json_member(text.as_bytes(), "model").map(|m| m.map(Cow::into_owned)), Ok(want));
        }

        /// Forms put together from the pieces that matter to the parser (delimiters, line ends,
        /// the model's disposition line, values) in any order never panic it.
        #[test]
        fn any_form_shaped_body_is_read_without_panic(
            pieces in prop::collection::vec(prop::sample::select(vec![
                "--b", "--b--", "\r\n", "\r\n\r\n", "Content-Disposition: form-data; name=\"model\"",
                "name=model", "a", "",
            ]), 0..24)
        ) {
            let _ = form_field(pieces.concat().as_bytes(), "b", "model");
        }

        /// Garbage never panics the scan.
        #[test]
        fn any_bytes_are_scanned_without_panic(body in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = json_member(&body, "model");
            let _ = form_field(&body, "b", "model");
        }
    }
}
