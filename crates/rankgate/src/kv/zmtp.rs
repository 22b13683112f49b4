//! Just enough ZMTP 3 (ZeroMQ's wire protocol, RFC 23/ZMTP 3.0 and 37/ZMTP 3.1) for a PUB socket
//! to talk to any ZeroMQ SUB (libzmq, pyzmq, the `zeromq` crate), and a SUB for tests and tools.
//!
//! A connection opens with a 64-byte greeting each way (signature, version 3.1, the NULL
//! mechanism, no encryption), then each side sends a READY command naming its socket type.
//! After that everything is frames: one flags byte (bit 0 MORE: another frame of the same
//! message follows, bit 1 LONG: an 8-byte size instead of 1 byte, bit 2 COMMAND), the size
//! (big-endian), the body. A subscriber says what it wants either as a ZMTP 3.0 message whose
//! first byte is 1 (subscribe) or 0 (cancel) followed by the topic prefix, or as a ZMTP 3.1
//! SUBSCRIBE / CANCEL command; both are accepted. A PING command is answered with PONG.
//!
//! rankgate's KV-event subscriber ([`Subscriber`], over a connection it made or accepted) and
//! the simulated engine's publisher share it. Written by hand rather than taken from a ZeroMQ
//! crate: a subscriber must refuse an oversized frame from its header, before allocating it,
//! and bound a whole message, which the pure-Rust crates do not offer; and the publisher must
//! never wait on a subscriber (each peer has its own bounded queue that drops its oldest
//! message when full, as vLLM's high-water mark does), where their PUB sockets await every
//! peer in turn.

use std::io;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// The biggest frame a peer may send us. Subscribers send topics and small commands; anything
/// bigger is garbage, refused before it is read.
pub const MAX_INCOMING_FRAME: u64 = 64 * 1024;

/// Frames in one message a subscriber takes at most (a KV-event message has 3).
pub const MAX_PARTS: usize = 16;

/// How long a peer has to complete the greeting and READY exchange.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A frame's body is read into a buffer that starts this big and grows as its bytes arrive,
/// never to the length its header announces: a peer that announces a large frame and stalls
/// costs what it sent, not what it promised.
const FIRST_READ: usize = 8 * 1024;

/// What can go wrong on a ZMTP connection.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    #[error("zmtp i/o: {0}")]
    Io(#[from] io::Error),
    #[error("zmtp: not a ZMTP 3 greeting")]
    BadGreeting,
    #[error("zmtp: unsupported security mechanism {0:?} (only NULL)")]
    Mechanism(String),
    #[error("zmtp: malformed command")]
    BadCommand,
    #[error("zmtp: expected READY, got {0:?}")]
    NotReady(String),
    #[error("zmtp: a {0} peer cannot talk to a {1} socket")]
    SocketType(String, &'static str),
    #[error("zmtp: frame of {0} bytes over the {1}-byte limit")]
    TooBig(u64, u64),
    #[error("zmtp: handshake timed out")]
    Timeout,
    #[error("zmtp: a message of more than {0} frames")]
    TooManyParts(usize),
    #[error("zmtp: a message not finished within {} s of its first byte", .0.as_secs())]
    Deadline(Duration),
}

/// The 64-byte greeting: signature, version 3.1, mechanism NULL, not a server (meaningless for
/// NULL), zero filler.
pub fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn check_greeting(g: &[u8; 64]) -> Result<(), ZmtpError> {
    if g[0] != 0xff || g[9] & 0x01 != 0x01 || g[10] < 3 {
        return Err(ZmtpError::BadGreeting);
    }
    let mech = &g[12..32];
    let name = String::from_utf8_lossy(mech.split(|&b| b == 0).next().unwrap_or_default());
    if name != "NULL" {
        return Err(ZmtpError::Mechanism(name.into_owned()));
    }
    Ok(())
}

/// Appends one frame.
pub fn frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    if body.len() > 255 {
        out.push(flags | LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

/// A whole multipart message, ready to write.
pub fn message(parts: &[&[u8]]) -> Bytes {
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.len() + 9).sum());
    for (i, p) in parts.iter().enumerate() {
        let more = if i + 1 < parts.len() { MORE } else { 0 };
        frame(&mut out, more, p);
    }
    out.into()
}

/// A command frame: name length, name, then the body.
fn command(name: &str, body: &[u8]) -> Vec<u8> {
    let mut c = Vec::with_capacity(1 + name.len() + body.len());
    c.push(name.len() as u8);
    c.extend_from_slice(name.as_bytes());
    c.extend_from_slice(body);
    let mut out = Vec::new();
    frame(&mut out, COMMAND, &c);
    out
}

/// READY with the one property peers check: the socket type.
fn ready(socket_type: &str) -> Vec<u8> {
    let mut props = Vec::new();
    props.push(b"Socket-Type".len() as u8);
    props.extend_from_slice(b"Socket-Type");
    props.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    props.extend_from_slice(socket_type.as_bytes());
    command("READY", &props)
}

/// One frame as read: its flags and body.
#[derive(Debug)]
pub struct Frame {
    pub flags: u8,
    pub body: Vec<u8>,
}

impl Frame {
    pub fn more(&self) -> bool {
        self.flags & MORE != 0
    }

    pub fn is_command(&self) -> bool {
        self.flags & COMMAND != 0
    }

    /// A command's name and body; `None` when malformed.
    fn command(&self) -> Option<(&[u8], &[u8])> {
        let n = usize::from(*self.body.first()?);
        let name = self.body.get(1..1 + n)?;
        Some((name, &self.body[1 + n..]))
    }
}

/// Reads one frame, refusing bodies over `max` bytes before reading them.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, max: u64) -> Result<Frame, ZmtpError> {
    let flags = r.read_u8().await?;
    read_frame_after(r, flags, max).await
}

/// The rest of a frame whose flags byte was read: its size (refused over `max` before any body
/// is read), then its body, in a buffer grown as the bytes arrive.
async fn read_frame_after<R: AsyncRead + Unpin>(
    r: &mut R,
    flags: u8,
    max: u64,
) -> Result<Frame, ZmtpError> {
    let len = if flags & LONG != 0 {
        r.read_u64().await?
    } else {
        u64::from(r.read_u8().await?)
    };
    if len > max {
        return Err(ZmtpError::TooBig(len, max));
    }
    // `len <= max`, and `max` is a limit of ours that fits in memory.
    let mut body = Vec::with_capacity((len as usize).min(FIRST_READ));
    let read = r.take(len).read_to_end(&mut body).await?;
    if (read as u64) < len {
        return Err(ZmtpError::Io(io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(Frame { flags, body })
}

/// The `Socket-Type` property of a READY body.
fn socket_type(mut props: &[u8]) -> Option<String> {
    while !props.is_empty() {
        let n = usize::from(props[0]);
        let name = props.get(1..1 + n)?;
        let len_at = 1 + n;
        let vlen = u32::from_be_bytes(props.get(len_at..len_at + 4)?.try_into().ok()?) as usize;
        let value = props.get(len_at + 4..len_at + 4 + vlen)?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            return Some(String::from_utf8_lossy(value).into_owned());
        }
        props = &props[len_at + 4 + vlen..];
    }
    None
}

/// Greeting and READY exchange as `ours`, accepting a peer of one of the `peers` types.
pub async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    ours: &'static str,
    peers: &[&str],
) -> Result<(), ZmtpError> {
    let exchange = async {
        s.write_all(&greeting()).await?;
        s.write_all(&ready(ours)).await?;
        s.flush().await?;
        let mut g = [0u8; 64];
        s.read_exact(&mut g).await?;
        check_greeting(&g)?;
        let f = read_frame(s, MAX_INCOMING_FRAME).await?;
        let (name, props) = f.command().ok_or(ZmtpError::BadCommand)?;
        if !f.is_command() || name != b"READY" {
            return Err(ZmtpError::NotReady(
                String::from_utf8_lossy(name).into_owned(),
            ));
        }
        let theirs = socket_type(props).ok_or(ZmtpError::BadCommand)?;
        if !peers.iter().any(|p| p.eq_ignore_ascii_case(&theirs)) {
            return Err(ZmtpError::SocketType(theirs, ours));
        }
        Ok(())
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, exchange)
        .await
        .map_err(|_| ZmtpError::Timeout)?
}

/// What a subscriber's frame asks of a publisher.
#[derive(Debug, PartialEq, Eq)]
pub enum SubRequest {
    Subscribe(Vec<u8>),
    Cancel(Vec<u8>),
    /// A heartbeat: answer with these PONG bytes.
    Ping(Vec<u8>),
    /// Anything else a PUB ignores.
    Other,
}

/// Reads a subscriber's frame as a PUB does.
pub fn sub_request(f: Frame) -> SubRequest {
    if f.is_command() {
        return match f.command() {
            Some((b"SUBSCRIBE", topic)) => SubRequest::Subscribe(topic.to_vec()),
            Some((b"CANCEL", topic)) => SubRequest::Cancel(topic.to_vec()),
            // PING: a 2-byte TTL, then a context the PONG echoes.
            Some((b"PING", body)) => {
                SubRequest::Ping(command("PONG", body.get(2..).unwrap_or(&[])))
            }
            _ => SubRequest::Other,
        };
    }
    match f.body.split_first() {
        Some((1, topic)) if !f.more() => SubRequest::Subscribe(topic.to_vec()),
        Some((0, topic)) if !f.more() => SubRequest::Cancel(topic.to_vec()),
        _ => SubRequest::Other,
    }
}

/// A minimal SUB socket over one connection, for tests and tools: it subscribes to a topic
/// prefix and reads whole multipart messages.
pub struct Subscriber<S> {
    stream: S,
    max_frame: u64,
    /// How long a message may take from its first byte to its last; `None`: no bound.
    deadline: Option<Duration>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Subscriber<S> {
    /// Handshakes as SUB with a PUB (or XPUB) peer and subscribes to `topic` (empty: all).
    /// Frames over `max_frame` bytes end the connection with [`ZmtpError::TooBig`].
    pub async fn start(mut stream: S, topic: &[u8], max_frame: u64) -> Result<Self, ZmtpError> {
        handshake(&mut stream, "SUB", &["PUB", "XPUB"]).await?;
        // The ZMTP 3.0 form, which 3.1 publishers accept as well.
        let mut sub = vec![1u8];
        sub.extend_from_slice(topic);
        let mut out = Vec::new();
        frame(&mut out, 0, &sub);
        stream.write_all(&out).await?;
        stream.flush().await?;
        Ok(Subscriber {
            stream,
            max_frame,
            deadline: None,
        })
    }

    /// Bounds each message: once its first byte has arrived, its last must follow within
    /// `deadline`, or [`Subscriber::recv`] fails with [`ZmtpError::Deadline`]. The wait for a
    /// message's first byte stays unbounded: a publisher with nothing to say is quiet.
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// The next whole message's frames; commands in between (PING) are skipped. A message of
    /// more than [`MAX_PARTS`] frames, or whose frames add up to more than `max_frame`, ends
    /// the connection: a publisher cannot grow the subscriber's memory without bound.
    pub async fn recv(&mut self) -> Result<Vec<Vec<u8>>, ZmtpError> {
        loop {
            let flags = self.stream.read_u8().await?;
            let deadline = self.deadline;
            let message = self.rest_of_message(flags);
            let read = match deadline {
                None => message.await,
                Some(d) => {
                    (tokio::time::timeout(d, message).await).map_err(|_| ZmtpError::Deadline(d))?
                }
            };
            if let Some(parts) = read? {
                return Ok(parts);
            }
        }
    }

    /// The message whose first flags byte was read; `None` when that was a lone command.
    async fn rest_of_message(&mut self, mut flags: u8) -> Result<Option<Vec<Vec<u8>>>, ZmtpError> {
        let mut parts = Vec::new();
        let mut total = 0u64;
        loop {
            let f = read_frame_after(&mut self.stream, flags, self.max_frame - total).await?;
            if !f.is_command() {
                let more = f.more();
                total += f.body.len() as u64;
                parts.push(f.body);
                if !more {
                    return Ok(Some(parts));
                }
                if parts.len() >= MAX_PARTS {
                    return Err(ZmtpError::TooManyParts(MAX_PARTS));
                }
            } else if parts.is_empty() {
                return Ok(None);
            }
            flags = self.stream.read_u8().await?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_switch_to_long_sizes_past_255_bytes() {
        let m = message(&[b"kv", &[0; 8], &[7; 300]]);
        assert_eq!(&m[..4], &[MORE, 2, b'k', b'v']);
        assert_eq!(&m[4..6], &[MORE, 8]);
        assert_eq!(m[14], LONG);
        assert_eq!(&m[15..23], &300u64.to_be_bytes());
        assert_eq!(m.len(), 23 + 300);
    }

    #[test]
    fn greeting_is_zmtp_3_with_null() {
        let g = greeting();
        assert!(check_greeting(&g).is_ok());
        let mut curve = g;
        curve[12..17].copy_from_slice(b"CURVE");
        assert!(matches!(check_greeting(&curve), Err(ZmtpError::Mechanism(m)) if m == "CURVE"));
        let mut v2 = g;
        v2[10] = 2;
        assert!(matches!(check_greeting(&v2), Err(ZmtpError::BadGreeting)));
    }

    #[test]
    fn both_subscription_forms_are_understood() {
        let msg = |flags, body: &[u8]| Frame {
            flags,
            body: body.to_vec(),
        };
        assert_eq!(
            sub_request(msg(0, b"\x01kv")),
            SubRequest::Subscribe(b"kv".to_vec())
        );
        assert_eq!(
            sub_request(msg(0, b"\x00kv")),
            SubRequest::Cancel(b"kv".to_vec())
        );
        assert_eq!(
            sub_request(msg(COMMAND, b"\x09SUBSCRIBEkv")),
            SubRequest::Subscribe(b"kv".to_vec())
        );
        assert_eq!(
            sub_request(msg(COMMAND, b"\x06CANCEL")),
            SubRequest::Cancel(vec![])
        );
        assert_eq!(sub_request(msg(COMMAND, b"\x20")), SubRequest::Other);
        assert_eq!(sub_request(msg(0, b"")), SubRequest::Other);
        let SubRequest::Ping(pong) = sub_request(msg(COMMAND, b"\x04PING\x00\x0aab")) else {
            panic!("ping");
        };
        assert_eq!(pong, b"\x04\x07\x04PONGab");
    }

    #[test]
    fn ready_properties_are_parsed_and_garbage_is_not_a_socket_type() {
        let r = ready("PUB");
        let f = Frame {
            flags: r[0],
            body: r[2..].to_vec(),
        };
        let (name, props) = f.command().expect("command");
        assert_eq!(name, b"READY");
        assert_eq!(socket_type(props).as_deref(), Some("PUB"));
        assert_eq!(socket_type(&[11, b'S']), None);
        assert_eq!(socket_type(&[200]), None);
    }

    #[tokio::test]
    async fn a_subscriber_and_a_publisher_handshake_over_a_pipe() {
        let (a, mut b) = tokio::io::duplex(4096);
        let publisher = async move {
            handshake(&mut b, "PUB", &["SUB", "XSUB"]).await?;
            let f = read_frame(&mut b, MAX_INCOMING_FRAME).await?;
            assert_eq!(sub_request(f), SubRequest::Subscribe(b"kv".to_vec()));
            b.write_all(&message(&[b"kv", b"x"])).await?;
            Ok::<_, ZmtpError>(b)
        };
        let (sub, publ) = tokio::join!(Subscriber::start(a, b"kv", 1024), publisher);
        let (mut sub, _b) = (sub.expect("sub"), publ.expect("pub"));
        assert_eq!(
            sub.recv().await.expect("msg"),
            vec![b"kv".to_vec(), b"x".to_vec()]
        );
    }

    #[tokio::test]
    async fn a_wrong_socket_type_or_a_huge_frame_is_refused() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let (x, y) = tokio::join!(
            handshake(&mut a, "PUB", &["SUB"]),
            handshake(&mut b, "PUB", &["SUB"])
        );
        assert!(matches!(x, Err(ZmtpError::SocketType(..))));
        assert!(matches!(y, Err(ZmtpError::SocketType(..))));
        let mut big = Vec::new();
        frame(&mut big, 0, &[0; 1000]);
        let mut r = &big[..];
        assert!(matches!(
            read_frame(&mut r, 100).await,
            Err(ZmtpError::TooBig(1000, 100))
        ));
    }
}
