//! A query string's parameters, as the admin API reads them.

/// The value of `key` in a query string, percent-decoded (model ids carry `/`).
pub(super) fn query_param(query: &str, key: &str) -> Option<String> {
    let raw = query
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))?;
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_params_are_decoded() {
        assert_eq!(
            query_param("a=1&model=meta-llama%2FLlama-3", "model").as_deref(),
            Some("meta-llama/Llama-3")
        );
        assert_eq!(query_param("models=x", "model"), None);
        assert_eq!(query_param("model=a%2", "model").as_deref(), Some("a%2"));
    }
}
