//! A bounded MessagePack reader for the engines' event batches: one pass over the bytes, no
//! allocation but what the caller keeps, every length checked against what is left before
//! anything is read, nesting limited. It reads the forms MessagePack has (msgspec, vLLM's
//! encoder, writes the smallest of each) and skips any value whole.

/// Containers nested deeper than this are refused (an event batch nests four deep).
const MAX_DEPTH: u32 = 32;

/// Why a payload could not be read, with where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("msgpack at byte {at}: {what}")]
pub struct MsgpackError {
    pub at: usize,
    pub what: String,
}

/// One scalar or container head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value<'a> {
    Nil,
    Bool(bool),
    Uint(u64),
    Int(i64),
    Float(f64),
    Str(&'a str),
    Bin(&'a [u8]),
    /// An array of this many values, which follow.
    Array(usize),
    /// A map of this many key-value pairs, which follow.
    Map(usize),
    /// An extension type: its tag and bytes.
    Ext(i8, &'a [u8]),
}

/// A cursor over a payload.
pub struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { bytes, at: 0 }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    pub fn error(&self, what: impl Into<String>) -> MsgpackError {
        MsgpackError {
            at: self.at,
            what: what.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgpackError> {
        if n > self.remaining() {
            return Err(self.error(format!("needs {n} more bytes, {} left", self.remaining())));
        }
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn be(&mut self, n: usize) -> Result<u64, MsgpackError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |v, b| (v << 8) | u64::from(*b)))
    }

    /// A length that must fit in what is left (each element takes at least one byte).
    fn len(&mut self, n: usize) -> Result<usize, MsgpackError> {
        let len = self.be(n)? as usize;
        if len > self.remaining() {
            return Err(self.error(format!(
                "length {len} passes the {} bytes left",
                self.remaining()
            )));
        }
        Ok(len)
    }

    fn str(&mut self, n: usize) -> Result<Value<'a>, MsgpackError> {
        let at = self.at;
        let b = self.take(n)?;
        std::str::from_utf8(b)
            .map(Value::Str)
            .map_err(|_| MsgpackError {
                at,
                what: "string is not UTF-8".into(),
            })
    }

    /// The next value (a container's head only).
    pub fn value(&mut self) -> Result<Value<'a>, MsgpackError> {
        let b = self.take(1)?[0];
        Ok(match b {
            0x00..=0x7f => Value::Uint(u64::from(b)),
            0x80..=0x8f => Value::Map(usize::from(b & 0x0f)),
            0x90..=0x9f => Value::Array(usize::from(b & 0x0f)),
            0xa0..=0xbf => self.str(usize::from(b & 0x1f))?,
            0xc0 => Value::Nil,
            0xc2 => Value::Bool(false),
            0xc3 => Value::Bool(true),
            0xc4..=0xc6 => {
                let n = self.len(1 << (b - 0xc4))?;
                Value::Bin(self.take(n)?)
            }
            0xc7..=0xc9 => {
                let n = self.len(1 << (b - 0xc7))?;
                let tag = self.take(1)?[0] as i8;
                Value::Ext(tag, self.take(n)?)
            }
            0xca => Value::Float(f64::from(f32::from_bits(self.be(4)? as u32))),
            0xcb => Value::Float(f64::from_bits(self.be(8)?)),
            0xcc..=0xcf => Value::Uint(self.be(1 << (b - 0xcc))?),
            0xd0..=0xd3 => {
                let n = 1usize << (b - 0xd0);
                let raw = self.be(n)?;
                let shift = 64 - 8 * n as u32;
                Value::Int(((raw << shift) as i64) >> shift)
            }
            0xd4..=0xd8 => {
                let tag = self.take(1)?[0] as i8;
                Value::Ext(tag, self.take(1 << (b - 0xd4))?)
            }
            0xd9..=0xdb => {
                let n = self.len(1 << (b - 0xd9))?;
                self.str(n)?
            }
            0xdc | 0xdd => Value::Array(self.len(if b == 0xdc { 2 } else { 4 })?),
            0xde | 0xdf => Value::Map(self.len(if b == 0xde { 2 } else { 4 })?),
            0xe0..=0xff => Value::Int(i64::from(b as i8)),
            0xc1 => {
                return Err(MsgpackError {
                    at: self.at - 1,
                    what: "0xc1 is not a msgpack type".into(),
                })
            }
        })
    }

    /// Skips the next value, containers whole.
    pub fn skip(&mut self) -> Result<(), MsgpackError> {
        self.skip_at(0)
    }

    fn skip_at(&mut self, depth: u32) -> Result<(), MsgpackError> {
        if depth > MAX_DEPTH {
            return Err(self.error(format!("nested deeper than {MAX_DEPTH}")));
        }
        match self.value()? {
            Value::Array(n) => (0..n).try_for_each(|_| self.skip_at(depth + 1)),
            Value::Map(n) => (0..2 * n).try_for_each(|_| self.skip_at(depth + 1)),
            _ => Ok(()),
        }
    }

    /// An array's length, or the error naming `what` was expected.
    pub fn array(&mut self, what: &str) -> Result<usize, MsgpackError> {
        match self.value()? {
            Value::Array(n) => Ok(n),
            v => Err(self.error(format!("{what}: expected an array, got {v:?}"))),
        }
    }

    /// An unsigned integer, or the error naming `what`.
    pub fn uint(&mut self, what: &str) -> Result<u64, MsgpackError> {
        match self.value()? {
            Value::Uint(n) => Ok(n),
            Value::Int(n) if n >= 0 => Ok(n as u64),
            v => Err(self.error(format!("{what}: expected an unsigned integer, got {v:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_reads_and_lengths_are_checked() {
        let mut r = Reader::new(&[0x93, 0x05, 0xcd, 0x01, 0x00, 0xa2, b'h', b'i']);
        assert_eq!(r.value().unwrap(), Value::Array(3));
        assert_eq!(r.value().unwrap(), Value::Uint(5));
        assert_eq!(r.value().unwrap(), Value::Uint(256));
        assert_eq!(r.value().unwrap(), Value::Str("hi"));
        assert_eq!(Reader::new(&[0xd0, 0xff]).value().unwrap(), Value::Int(-1));
        assert_eq!(Reader::new(&[0xf0]).value().unwrap(), Value::Int(-16));
        assert_eq!(Reader::new(&[0xc0]).value().unwrap(), Value::Nil);
        let f = [0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0];
        assert_eq!(Reader::new(&f).value().unwrap(), Value::Float(1.0));
        // A declared length beyond the payload is refused before anything is read.
        let e = Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff])
            .value()
            .unwrap_err();
        assert!(e.what.contains("passes"), "{e}");
        assert!(Reader::new(&[0xc1]).value().is_err());
        assert!(Reader::new(&[0xa3, b'a']).value().is_err());
        let mut deep = vec![0x91u8; 100];
        deep.push(0xc0);
        assert!(Reader::new(&deep)
            .skip()
            .unwrap_err()
            .what
            .contains("nested"));
    }

    #[test]
    fn skip_passes_a_whole_container() {
        let bytes = [0x82, 0xa1, b'a', 0x92, 1, 2, 0xa1, b'b', 0xc0, 0x07];
        let mut r = Reader::new(&bytes);
        r.skip().unwrap();
        assert_eq!(r.value().unwrap(), Value::Uint(7));
    }
}
