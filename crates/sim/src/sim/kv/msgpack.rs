//! The few MessagePack forms a KV-event batch needs, written the way msgspec (vLLM's encoder)
//! writes them: every integer in its smallest form, floats as float64, strings and containers
//! with the shortest length prefix. Byte-identical output to the engine is the point (a router's
//! decoder is tested against the sim as against the real capture), so no general-purpose
//! serializer with its own choices sits in between.

/// `nil`.
pub fn nil(out: &mut Vec<u8>) {
    out.push(0xc0);
}

/// A non-negative integer in its smallest form: positive fixint, uint8, uint16, uint32, uint64.
pub fn uint(out: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        out.push(v as u8);
    } else if v <= u64::from(u8::MAX) {
        out.extend_from_slice(&[0xcc, v as u8]);
    } else if v <= u64::from(u16::MAX) {
        out.push(0xcd);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= u64::from(u32::MAX) {
        out.push(0xce);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

/// A float64 (msgspec never narrows Python floats to float32).
pub fn float64(out: &mut Vec<u8>, v: f64) {
    out.push(0xcb);
    out.extend_from_slice(&v.to_be_bytes());
}

/// A UTF-8 string: fixstr, str8, str16 or str32.
pub fn str(out: &mut Vec<u8>, s: &str) {
    let n = s.len();
    if n < 32 {
        out.push(0xa0 | n as u8);
    } else if n <= usize::from(u8::MAX) {
        out.extend_from_slice(&[0xd9, n as u8]);
    } else if n <= usize::from(u16::MAX) {
        out.push(0xda);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&len32(n).to_be_bytes());
    }
    out.extend_from_slice(s.as_bytes());
}

/// An array header for `n` elements: fixarray, array16 or array32.
pub fn array(out: &mut Vec<u8>, n: usize) {
    header(out, n, 0x90, 0xdc);
}

/// A map header for `n` key-value pairs: fixmap, map16 or map32.
pub fn map(out: &mut Vec<u8>, n: usize) {
    header(out, n, 0x80, 0xde);
}

fn header(out: &mut Vec<u8>, n: usize, fix: u8, sixteen: u8) {
    if n < 16 {
        out.push(fix | n as u8);
    } else if n <= usize::from(u16::MAX) {
        out.push(sixteen);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        // The 32-bit form is the next code after the 16-bit one, for arrays and maps alike.
        out.push(sixteen + 1);
        out.extend_from_slice(&len32(n).to_be_bytes());
    }
}

/// A length in the format's widest (32-bit) prefix. Nothing the sim encodes comes near 4 GiB;
/// saturating keeps the function total.
fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut v = Vec::new();
        f(&mut v);
        v
    }

    #[test]
    fn integers_take_their_smallest_form() {
        assert_eq!(enc(|o| uint(o, 0)), [0x00]);
        assert_eq!(enc(|o| uint(o, 127)), [0x7f]);
        assert_eq!(enc(|o| uint(o, 128)), [0xcc, 0x80]);
        assert_eq!(enc(|o| uint(o, 256)), [0xcd, 0x01, 0x00]);
        assert_eq!(enc(|o| uint(o, 65_536)), [0xce, 0, 1, 0, 0]);
        assert_eq!(
            enc(|o| uint(o, u64::MAX)),
            [0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]
        );
    }

    #[test]
    fn strings_and_containers_use_the_shortest_prefix() {
        assert_eq!(enc(|o| str(o, "kv")), [0xa2, b'k', b'v']);
        let long = "x".repeat(40);
        assert_eq!(enc(|o| str(o, &long))[..2], [0xd9, 40]);
        assert_eq!(enc(|o| array(o, 3)), [0x93]);
        assert_eq!(enc(|o| array(o, 384)), [0xdc, 0x01, 0x80]);
        assert_eq!(enc(|o| array(o, 70_000))[0], 0xdd);
        assert_eq!(enc(|o| map(o, 11)), [0x8b]);
        assert_eq!(enc(|o| map(o, 16))[0], 0xde);
        assert_eq!(enc(nil), [0xc0]);
        assert_eq!(enc(|o| float64(o, 1.5))[..3], [0xcb, 0x3f, 0xf8]);
    }
}
