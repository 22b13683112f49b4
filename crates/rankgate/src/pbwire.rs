//! Editing a protobuf message at the wire level: setting one varint field (the DP rank of a
//! `GenerateRequest`) while every other byte, of fields rankgate knows and of fields it does
//! not, reaches the engine as the client sent it. Decoding into rankgate's own protos and
//! encoding again would drop unknown fields and reorder the rest.
//!
//! A message is a sequence of fields, each a varint key (`number << 3 | wire type`) and a
//! payload whose length the wire type gives. Only the top level is walked; nested messages are
//! length-delimited payloads copied whole.

/// Why a message could not be edited.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("protobuf message truncated at byte {0}")]
    Truncated(usize),
    #[error("protobuf varint too long at byte {0}")]
    LongVarint(usize),
    #[error("protobuf wire type {kind} (field {field}) at byte {at} is not supported")]
    WireType { kind: u8, field: u64, at: usize },
    #[error("protobuf field number 0 at byte {0}")]
    FieldZero(usize),
}

/// Reads a varint at `at`; returns it and the index after it.
fn varint(b: &[u8], at: usize) -> Result<(u64, usize), WireError> {
    let mut v = 0u64;
    for i in 0..10 {
        let byte = *b.get(at + i).ok_or(WireError::Truncated(at + i))?;
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok((v, at + i + 1));
        }
    }
    Err(WireError::LongVarint(at))
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The fields of a message's top level: `(field number, start, end)` of each whole field (key
/// and payload), in order.
pub fn fields(msg: &[u8]) -> Result<Vec<(u64, usize, usize)>, WireError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < msg.len() {
        let start = at;
        let (key, next) = varint(msg, at)?;
        let (field, kind) = (key >> 3, (key & 7) as u8);
        if field == 0 {
            return Err(WireError::FieldZero(start));
        }
        at = match kind {
            0 => varint(msg, next)?.1,
            1 => next + 8,
            2 => {
                let (len, body) = varint(msg, next)?;
                body.checked_add(usize::try_from(len).map_err(|_| WireError::Truncated(body))?)
                    .ok_or(WireError::Truncated(body))?
            }
            5 => next + 4,
            // Groups (3, 4) are long deprecated and no engine proto uses them.
            _ => {
                return Err(WireError::WireType {
                    kind,
                    field,
                    at: start,
                })
            }
        };
        if at > msg.len() {
            return Err(WireError::Truncated(msg.len()));
        }
        out.push((field, start, at));
    }
    Ok(out)
}

/// The payload of one whole length-delimited field (key, length, payload), as [`fields`] gives
/// it; `None` for another wire type.
pub fn payload(field: &[u8]) -> Option<&[u8]> {
    let (key, at) = varint(field, 0).ok()?;
    if key & 7 != 2 {
        return None;
    }
    let (len, body) = varint(field, at).ok()?;
    field.get(body..body.checked_add(usize::try_from(len).ok()?)?)
}

/// `msg` without the top-level fields `drop` picks (given the field number and the whole
/// field's bytes); every other field keeps its bytes and order.
pub fn without(msg: &[u8], mut drop: impl FnMut(u64, &[u8]) -> bool) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(msg.len());
    for (f, start, end) in fields(msg)? {
        if !drop(f, &msg[start..end]) {
            out.extend_from_slice(&msg[start..end]);
        }
    }
    Ok(out)
}

/// `msg` with varint field `field` set to `value` (an `int32` / `int64` / `uint` field): any
/// occurrence of the field is removed and one is appended. Every other field keeps its bytes
/// and its order. (Appending is valid protobuf: for a scalar the last occurrence wins.)
pub fn set_varint(msg: &[u8], field: u64, value: u64) -> Result<Vec<u8>, WireError> {
    let mut out = without(msg, |f, _| f == field)?;
    out.reserve(12);
    put_varint(&mut out, field << 3);
    put_varint(&mut out, value);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One field: number, wire type and payload, encoded.
    fn encode(field: u64, kind: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        put_varint(&mut out, field << 3 | u64::from(kind));
        if kind == 2 {
            put_varint(&mut out, payload.len() as u64);
        }
        out.extend_from_slice(payload);
        out
    }

    pub(super) fn field_strategy() -> impl Strategy<Value = Vec<u8>> {
        (1u64..40, 0usize..4).prop_flat_map(|(field, kind)| match kind {
            0 => any::<u64>()
                .prop_map(move |v| {
                    let mut p = Vec::new();
                    put_varint(&mut p, v);
                    encode(field, 0, &p)
                })
                .boxed(),
            1 => any::<[u8; 8]>()
                .prop_map(move |p| encode(field, 1, &p))
                .boxed(),
            2 => prop::collection::vec(any::<u8>(), 0..40)
                .prop_map(move |p| encode(field, 2, &p))
                .boxed(),
            _ => any::<[u8; 4]>()
                .prop_map(move |p| encode(field, 5, &p))
                .boxed(),
        })
    }

    #[test]
    fn sets_the_field_and_keeps_the_rest_byte_for_byte() {
        let unknown = encode(1000, 2, b"not in any proto");
        let mut msg = encode(1, 2, b"req-1");
        msg.extend(encode(9, 0, &[3]));
        msg.extend(&unknown);
        let out = set_varint(&msg, 9, 1).unwrap();
        let mut want = encode(1, 2, b"req-1");
        want.extend(&unknown);
        want.extend(encode(9, 0, &[1]));
        assert_eq!(out, want);
        assert_eq!(set_varint(&[], 9, 300).unwrap(), [0x48, 0xac, 0x02]);
    }

    /// What prost decodes from the edit: the field set, the other fields intact.
    #[test]
    fn prost_reads_the_edited_field() {
        use prost::Message;
        let req = crate::proto::vllm::GetLoadsRequest {
            dp_rank: Some(5),
            include: vec!["core".into(), "queues".into()],
        };
        let out = set_varint(&req.encode_to_vec(), 1, 2).unwrap();
        let back = crate::proto::vllm::GetLoadsRequest::decode(&out[..]).unwrap();
        assert_eq!(back.dp_rank, Some(2));
        assert_eq!(back.include, req.include);
    }

    #[test]
    fn broken_messages_are_errors() {
        assert_eq!(fields(&[0x0a, 0x05, b'a']), Err(WireError::Truncated(3)));
        assert!(matches!(
            fields(&[0x0b]),
            Err(WireError::WireType { kind: 3, .. })
        ));
        assert_eq!(fields(&[0x00, 0x01]), Err(WireError::FieldZero(0)));
        assert_eq!(fields(&[0x08; 1]), Err(WireError::Truncated(1)));
        assert!(matches!(
            fields(&[0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
            Err(WireError::LongVarint(_))
        ));
    }

    proptest! {
        /// Whatever the message holds, the result is the other fields in order, then the field.
        #[test]
        fn only_the_rank_field_changes(
            parts in prop::collection::vec(field_strategy(), 0..12),
            value in 0u64..1 << 31,
        ) {
            let msg: Vec<u8> = parts.concat();
            let out = set_varint(&msg, 9, value).unwrap();
            let kept: Vec<u8> = fields(&msg).unwrap().into_iter()
                .filter(|&(f, _, _)| f != 9)
                .flat_map(|(_, s, e)| msg[s..e].to_vec())
                .collect();
            let mut tail = Vec::new();
            put_varint(&mut tail, 9 << 3);
            put_varint(&mut tail, value);
            prop_assert_eq!(&out[..kept.len()], &kept[..]);
            prop_assert_eq!(&out[kept.len()..], &tail[..]);
            let nines: Vec<_> = fields(&out).unwrap().into_iter().filter(|f| f.0 == 9).collect();
            prop_assert_eq!(nines.len(), 1);
        }

        /// Garbage is an error or an edit, never a panic.
        #[test]
        fn any_bytes_never_panic(msg in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = set_varint(&msg, 9, 1);
        }
    }
}

/// Rewrites the messages of a gRPC request body as its chunks arrive: each message is a
/// length-prefixed frame (1 byte compressed flag, 4 bytes big-endian length, the message), and
/// chunks split frames anywhere. Each whole message gets `field` set to `value`; the output is
/// again whole frames.
#[derive(Debug, Default)]
pub struct FrameRewriter {
    pending: Vec<u8>,
}

/// Why a gRPC body could not be rewritten.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("a compressed gRPC message cannot have its rank set (send it uncompressed)")]
    Compressed,
    #[error("gRPC message of {0} bytes exceeds the limit")]
    TooLarge(usize),
    #[error("{0}")]
    Message(#[from] WireError),
    #[error("gRPC body ended inside a message ({0} bytes left over)")]
    Cut(usize),
}

impl FrameRewriter {
    /// Feeds one chunk; returns the rewritten frames it completed (possibly none).
    pub fn feed(
        &mut self,
        chunk: &[u8],
        field: u64,
        value: u64,
        max: usize,
    ) -> Result<Vec<u8>, FrameError> {
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::new();
        let mut at = 0;
        while let Some(head) = self.pending.get(at..at + 5) {
            let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
            if head[0] != 0 {
                return Err(FrameError::Compressed);
            }
            if len > max {
                return Err(FrameError::TooLarge(len));
            }
            let Some(msg) = self.pending.get(at + 5..at + 5 + len) else {
                break;
            };
            let edited = set_varint(msg, field, value)?;
            out.push(0);
            out.extend_from_slice(&(edited.len() as u32).to_be_bytes());
            out.extend_from_slice(&edited);
            at += 5 + len;
        }
        self.pending.drain(..at);
        Ok(out)
    }

    /// At the end of the body: `Err` when a message was cut short.
    pub fn finish(&self) -> Result<(), FrameError> {
        match self.pending.len() {
            0 => Ok(()),
            n => Err(FrameError::Cut(n)),
        }
    }
}

#[cfg(test)]
mod frame_tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(msg: &[u8]) -> Vec<u8> {
        let mut f = vec![0];
        f.extend_from_slice(&(msg.len() as u32).to_be_bytes());
        f.extend_from_slice(msg);
        f
    }

    proptest! {
        /// However the body is cut into chunks, the frames that come out are the messages
        /// edited one by one.
        #[test]
        fn chunking_does_not_matter(
            msgs in prop::collection::vec(prop::collection::vec(super::tests::field_strategy(), 0..5).prop_map(|p| p.concat()), 1..4),
            cuts in prop::collection::vec(1usize..7, 0..10),
        ) {
            let body: Vec<u8> = msgs.iter().flat_map(|m| frame(m)).collect();
            let want: Vec<u8> = msgs.iter().flat_map(|m| frame(&set_varint(m, 9, 1).unwrap())).collect();
            let mut r = FrameRewriter::default();
            let mut got = Vec::new();
            let mut at = 0;
            for c in cuts {
                let end = (at + c).min(body.len());
                got.extend(r.feed(&body[at..end], 9, 1, 1 << 20).unwrap());
                at = end;
            }
            got.extend(r.feed(&body[at..], 9, 1, 1 << 20).unwrap());
            prop_assert!(r.finish().is_ok());
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn refuses_what_it_cannot_edit() {
        let mut r = FrameRewriter::default();
        assert_eq!(
            r.feed(&[1, 0, 0, 0, 0], 9, 1, 100),
            Err(FrameError::Compressed)
        );
        let mut r = FrameRewriter::default();
        assert_eq!(
            r.feed(&[0, 0, 0, 1, 0], 9, 1, 100),
            Err(FrameError::TooLarge(256))
        );
        let mut r = FrameRewriter::default();
        assert_eq!(r.feed(&[0, 0, 0, 0, 3, 0x0a], 9, 1, 100), Ok(vec![]));
        assert_eq!(r.finish(), Err(FrameError::Cut(6)));
    }
}
