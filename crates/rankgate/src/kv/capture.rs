//! Reads a recorded capture of KV-event messages (`tests/fixtures/vllm-0.32-kv-events/
//! events-dp2.jsonl`: one JSON line a message, its raw frames in base64): the router's decoder
//! tests, the subscriber's tests over TCP, the ingest bench and the simulator's encoder check
//! all replay it through this one reader.

use serde_json::Value;

/// One recorded message.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// The rank whose socket it came from.
    pub rank: u32,
    /// Its frames: topic, sequence number, payload.
    pub frames: Vec<Vec<u8>>,
    /// The line as JSON (`decoded`: the payload as the engine meant it; `seq`).
    pub line: Value,
}

/// Every message of a capture's text; `Err` names the line that is not one.
pub fn read(text: &str) -> Result<Vec<Recorded>, String> {
    (text.lines().enumerate())
        .map(|(i, l)| {
            let bad = |what: &str| format!("capture line {}: {what}", i + 1);
            let line: Value = serde_json::from_str(l).map_err(|e| bad(&e.to_string()))?;
            let rank = line["rank_endpoint"]
                .as_u64()
                .ok_or_else(|| bad("no rank_endpoint"))? as u32;
            let frames = (line["parts_b64"]
                .as_array()
                .ok_or_else(|| bad("no parts_b64"))?
                .iter())
            .map(|p| {
                p.as_str()
                    .and_then(base64)
                    .ok_or_else(|| bad("a frame is not base64"))
            })
            .collect::<Result<_, _>>()?;
            Ok(Recorded { rank, frames, line })
        })
        .collect()
}

/// Standard base64 (padding optional); `None` on any other character.
pub fn base64(s: &str) -> Option<Vec<u8>> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let digits = (s.bytes().filter(|&c| c != b'='))
        .map(val)
        .collect::<Option<Vec<u8>>>()?;
    let mut out = Vec::with_capacity(digits.len() * 3 / 4);
    for quad in digits.chunks(4) {
        let n = (quad.iter().enumerate()).fold(0u32, |n, (i, &d)| n | u32::from(d) << (18 - 6 * i));
        out.extend_from_slice(&n.to_be_bytes()[1..quad.len()]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_round_numbers() {
        assert_eq!(super::base64("a3Y=").unwrap(), b"kv");
        assert_eq!(super::base64("AAAAAAAAAAM=").unwrap(), 3u64.to_be_bytes());
        assert_eq!(super::base64("a3Y!"), None);
    }
}
