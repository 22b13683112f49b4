//! W3C Trace Context: reading a client's `traceparent` and writing the one an engine (or an
//! exported span) continues. A leaf both the proxy's trace layer and the OTLP exporter use.

use http::header::{HeaderMap, HeaderName, HeaderValue};

pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// The trace context the request continues: what the engine is told, and what an exported span
/// is the child of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: u128,
    /// The client's span, when it sent a valid `traceparent`.
    pub parent: Option<u64>,
    /// rankgate's hop, the engine's parent.
    pub hop: u64,
    pub sampled: bool,
}

/// The trace id, parent id and flags of a valid `traceparent` (W3C Trace Context level 1):
/// version `00` exactly `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`, ids not all
/// zero, lowercase; a later version may append fields after the four it shares with `00`.
fn parse_traceparent(v: &[u8]) -> Option<(u128, u64, u8)> {
    let hex = |s: &[u8]| {
        s.iter()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    };
    if v.len() < 55 || !hex(&v[..2]) || &v[..2] == b"ff" || (&v[..2] == b"00" && v.len() != 55) {
        return None;
    }
    if v.len() > 55 && v[55] != b'-' {
        return None;
    }
    let (trace, parent, flags) = (&v[3..35], &v[36..52], &v[53..55]);
    let dashes = v[2] == b'-' && v[35] == b'-' && v[52] == b'-';
    if !dashes || !hex(trace) || !hex(parent) || !hex(flags) {
        return None;
    }
    let num = |s: &[u8]| u128::from_str_radix(std::str::from_utf8(s).ok()?, 16).ok();
    let (trace, parent, flags) = (num(trace)?, num(parent)?, num(flags)?);
    (trace != 0 && parent != 0).then_some((trace, parent as u64, flags as u8))
}

/// `traceparent` for `trace_id`, with `span` as the parent the receiver sees.
pub fn traceparent(trace_id: u128, span: u64, sampled: bool) -> HeaderValue {
    let mut v = [0u8; 55];
    v[..3].copy_from_slice(b"00-");
    let mut trace = [0u8; 32];
    hex_into(trace_id, &mut trace);
    v[3..35].copy_from_slice(&trace);
    v[35] = b'-';
    let mut parent = [0u8; 16];
    hex_into(u128::from(span), &mut parent);
    v[36..52].copy_from_slice(&parent);
    v[52..].copy_from_slice(if sampled { b"-01" } else { b"-00" });
    shared_value(v)
}

/// A header value that owns `bytes` behind a reference count from the start. One made by
/// `HeaderValue::from_bytes` is a plain vector until its first clone, which then allocates the
/// count (the request's head is cloned for a retry, the request id onto the answer): about 300
/// instructions per request for the request id and `traceparent` (bench/instructions.sh).
pub fn shared_value<const N: usize>(bytes: [u8; N]) -> HeaderValue {
    HeaderValue::from_maybe_shared(bytes::Bytes::from_owner(bytes))
        .unwrap_or(HeaderValue::from_static(""))
}

/// Continues the client's trace with rankgate's own hop as the engine's parent, or starts one
/// (sampled, so a tracing engine records it). An invalid `traceparent` is replaced, and its
/// `tracestate` dropped with it, as the spec requires.
pub fn trace_context(h: &mut HeaderMap) -> TraceContext {
    let mut sent = h.get_all(&TRACEPARENT).iter();
    let valid = match (sent.next(), sent.next()) {
        (Some(v), None) => parse_traceparent(v.as_bytes()),
        _ => None,
    };
    let hop = rand::random::<u64>() | 1;
    let tc = match valid {
        Some((trace_id, parent, flags)) => TraceContext {
            trace_id,
            parent: Some(parent),
            hop,
            sampled: flags & 1 == 1,
        },
        None => {
            h.remove(&TRACESTATE);
            TraceContext {
                trace_id: rand::random::<u128>() | 1,
                parent: None,
                hop,
                sampled: true,
            }
        }
    };
    h.insert(TRACEPARENT, traceparent(tc.trace_id, tc.hop, tc.sampled));
    tc
}

/// Lowercase hex of `n`'s low `N / 2` bytes into `out` (`N` even, at most 32). Two digits per
/// step from a table: one digit per step on a `u128` (each of whose shifts takes two registers)
/// cost about 300 instructions per request for the request id and `traceparent`.
#[inline]
pub fn hex_into<const N: usize>(n: u128, out: &mut [u8; N]) {
    const { assert!(N.is_multiple_of(2) && N <= 32) };
    let bytes = n.to_be_bytes();
    for (pair, b) in out.chunks_exact_mut(2).zip(&bytes[16 - N / 2..]) {
        pair.copy_from_slice(&HEX_PAIRS[usize::from(*b)]);
    }
}

/// Every byte's two lowercase hex digits.
static HEX_PAIRS: [[u8; 2]; 256] = {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut pairs = [[0u8; 2]; 256];
    let mut b = 0;
    while b < 256 {
        pairs[b] = [HEX[b >> 4], HEX[b & 0xf]];
        b += 1;
    }
    pairs
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_digits_are_the_low_bytes_of_the_number_in_order() {
        for n in [
            0u128,
            1,
            0xabcdef,
            u128::MAX,
            0x0123_4567_89ab_cdef_fedc_ba98_7654_3210,
        ] {
            let mut long = [0u8; 32];
            hex_into(n, &mut long);
            assert_eq!(std::str::from_utf8(&long).unwrap(), format!("{n:032x}"));
            let mut short = [0u8; 16];
            hex_into(n, &mut short);
            assert_eq!(
                std::str::from_utf8(&short).unwrap(),
                format!("{:016x}", n as u64)
            );
        }
    }

    #[test]
    fn a_valid_trace_is_continued_with_a_new_parent_and_an_invalid_one_replaced() {
        let client = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut h = HeaderMap::new();
        h.insert(TRACEPARENT, HeaderValue::from_static(client));
        h.insert(TRACESTATE, HeaderValue::from_static("congo=t61rcWkgMzE"));
        let tc = trace_context(&mut h);
        assert_eq!(tc.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(tc.parent, Some(0x00f067aa0ba902b7));
        assert!(tc.sampled);
        let v = h[&TRACEPARENT].to_str().unwrap().to_string();
        assert_eq!(&v[..36], &client[..36], "same version and trace id");
        assert_eq!(
            &v[36..52],
            format!("{:016x}", tc.hop),
            "rankgate's own hop is the parent"
        );
        assert_eq!(&v[52..], "-01");
        assert_eq!(h[&TRACESTATE], "congo=t61rcWkgMzE");
        assert!(parse_traceparent(v.as_bytes()).is_some());

        // Not sampled by the client: not sampled on.
        let mut h = HeaderMap::new();
        h.insert(
            TRACEPARENT,
            HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"),
        );
        assert!(!trace_context(&mut h).sampled);
        assert!(h[&TRACEPARENT].to_str().unwrap().ends_with("-00"));

        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "garbage",
        ] {
            let mut h = HeaderMap::new();
            h.insert(TRACEPARENT, HeaderValue::from_str(bad).unwrap());
            h.insert(TRACESTATE, HeaderValue::from_static("a=b"));
            let tc = trace_context(&mut h);
            let v = h[&TRACEPARENT].to_str().unwrap();
            assert_ne!(
                &v[3..35],
                bad.get(3..35).unwrap_or(""),
                "{bad}: a new trace"
            );
            assert_eq!(tc.parent, None, "{bad}");
            assert!(parse_traceparent(v.as_bytes()).is_some(), "{bad} -> {v}");
            assert!(
                !h.contains_key(&TRACESTATE),
                "{bad}: its tracestate goes with it"
            );
        }
        // A later version's extra fields are allowed.
        assert!(parse_traceparent(
            b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-later"
        )
        .is_some());
    }
}
