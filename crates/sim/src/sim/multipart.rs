//! Just enough `multipart/form-data` (RFC 7578) to read an audio upload: each part's name, and
//! its text or, for a file part, its name and size. The audio itself is never looked at, so the
//! parts are not decoded further (no transfer encodings, no nested multiparts).

use serde_json::{json, Map, Value};

/// Why a body could not be read as a form.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormError {
    #[error("content type {0:?} is not multipart/form-data with a boundary")]
    NotMultipart(String),
    #[error("malformed multipart body: {0}")]
    Malformed(&'static str),
}

/// The form's fields as a JSON object: a text field as its string (invalid UTF-8 replaced), a
/// file part (one with a `filename`) as `{"filename": .., "bytes": <size>}`.
pub fn fields(content_type: &str, body: &[u8]) -> Result<Map<String, Value>, FormError> {
    let boundary =
        boundary(content_type).ok_or_else(|| FormError::NotMultipart(content_type.to_string()))?;
    let delimiter = format!("--{boundary}").into_bytes();
    let mut at = find(body, &delimiter, 0).ok_or(FormError::Malformed("no boundary"))?;
    let mut out = Map::new();
    loop {
        at += delimiter.len();
        let rest = &body[at..];
        if rest.starts_with(b"--") {
            return Ok(out);
        }
        if !rest.starts_with(b"\r\n") {
            return Err(FormError::Malformed("boundary not followed by CRLF"));
        }
        let head_start = at + 2;
        let head_end =
            find(body, b"\r\n\r\n", head_start).ok_or(FormError::Malformed("part head unended"))?;
        let content_start = head_end + 4;
        let mut close = b"\r\n".to_vec();
        close.extend_from_slice(&delimiter);
        let content_end =
            find(body, &close, content_start).ok_or(FormError::Malformed("part unended"))?;
        let head = String::from_utf8_lossy(&body[head_start..head_end]);
        let (name, filename) = disposition(&head).ok_or(FormError::Malformed("unnamed part"))?;
        let content = &body[content_start..content_end];
        let value = match filename {
            Some(f) => json!({"filename": f, "bytes": content.len()}),
            None => Value::String(String::from_utf8_lossy(content).into_owned()),
        };
        out.insert(name, value);
        at = content_end + 2;
    }
}

/// The `boundary` parameter of a `multipart/form-data` content type, unquoted.
fn boundary(content_type: &str) -> Option<&str> {
    let mut params = content_type.split(';');
    let media = params.next()?.trim();
    if !media.eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    params
        .filter_map(|p| p.trim().split_once('='))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("boundary"))
        .map(|(_, v)| v.trim().trim_matches('"'))
        .filter(|b| !b.is_empty())
}

/// `name` and `filename` from a part's `Content-Disposition: form-data; name=".."` line.
fn disposition(head: &str) -> Option<(String, Option<String>)> {
    let line = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("content-disposition")
            .then_some(v)
    })?;
    let param = |key: &str| {
        line.split(';').find_map(|p| {
            let (k, v) = p.trim().split_once('=')?;
            (k.trim() == key).then(|| v.trim().trim_matches('"').to_string())
        })
    };
    Some((param("name")?, param("filename")))
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    hay.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|i| i + from)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CT: &str = "multipart/form-data; boundary=\"xyz\"";

    #[test]
    fn reads_text_fields_and_file_sizes() {
        let body = b"--xyz\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n\
--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
Content-Type: audio/wav\r\n\r\nRIFF\r\n\x00\x01\r\n--xyz--\r\n";
        let f = fields(CT, body).unwrap();
        assert_eq!(f["model"], "whisper");
        assert_eq!(f["file"], json!({"filename": "a.wav", "bytes": 8}));
    }

    #[test]
    fn refuses_what_is_not_a_form() {
        assert!(matches!(
            fields("application/json", b"{}"),
            Err(FormError::NotMultipart(_))
        ));
        assert!(matches!(
            fields(CT, b"--xyz\r\nno head end"),
            Err(FormError::Malformed(_))
        ));
        assert!(matches!(fields(CT, b""), Err(FormError::Malformed(_))));
        assert_eq!(fields(CT, b"--xyz--\r\n").unwrap().len(), 0);
    }
}
