//! The engine's replay socket (vLLM's `replay_endpoint`, SGLang's too): after a gap in a
//! rank's sequence, or on joining an engine already publishing, rankgate asks it for the
//! batches it missed before applying the message that showed the gap, so that an index that
//! lost events stays complete when the engine still has them.
//!
//! The wire (vLLM's `ZmqEventPublisher._service_replay`): the engine binds a ZeroMQ ROUTER
//! (DP rank `r` at the endpoint's port + `r`) and keeps its last `buffer_steps` batches (10,000
//! by default). A request is two frames, an empty delimiter and the first sequence number
//! wanted (8 bytes, big-endian); the ROUTER prefixes the client's identity, so it sees three.
//! It answers with one message per buffered batch from that number on, each three frames: the
//! empty delimiter, the batch's sequence number (8 bytes) and its payload (the same msgpack as
//! on the PUB socket, without the topic), then an end marker whose sequence is -1 (eight 0xff
//! bytes) and whose payload is empty. rankgate speaks as a DEALER (which, unlike a REQ socket,
//! takes the many answers to one request).
//!
//! A replay is bounded: [`CONNECT_TIMEOUT`] to connect, [`REPLAY_DEADLINE`] for the whole
//! exchange, [`MAX_REPLAY_MESSAGES`] messages and [`MAX_REPLAY_BYTES`] bytes, each frame at most
//! a batch's bound; it stops as soon as it reaches the message that showed the gap (what follows
//! comes live). An engine that answers garbage, too much or too slowly costs one bounded
//! attempt; the rank then holds what it saw as a lower bound ([`super::writer`]). The message
//! stream waits meanwhile (the publisher's queue holds it), so events stay in order.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWriteExt};
use tokio::net::TcpStream;

use super::event::{decode, Message, MAX_PAYLOAD};
use super::writer::Writer;
use super::zmtp::{self, ZmtpError, MAX_PARTS};

/// Longest wait for the replay socket's TCP connect.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest a whole replay may take, connect and handshake included.
pub const REPLAY_DEADLINE: Duration = Duration::from_secs(10);
/// Messages one replay reads at most: twice vLLM's default `buffer_steps`.
pub const MAX_REPLAY_MESSAGES: u64 = 20_000;
/// Bytes one replay reads at most (vLLM's default buffer of 10,000 batches of a few KB fits).
pub const MAX_REPLAY_BYTES: u64 = 64 << 20;

/// The end marker's sequence number: -1 as a signed 64-bit integer.
const END: u64 = u64::MAX;

fn lock(w: &Mutex<Writer>) -> std::sync::MutexGuard<'_, Writer> {
    w.lock().unwrap_or_else(|p| p.into_inner())
}

/// Applies one message of the rank, first asking the engine's replay socket (when the rank has
/// one) for what is missing before it.
pub async fn deliver(w: &Arc<Mutex<Writer>>, msg: &Message) {
    let ask = lock(w).replay_for(msg.seq);
    if let Some((addr, from)) = ask {
        let outcome = fetch(&addr, from, msg.seq, &msg.topic, w).await;
        lock(w).replay_done(outcome);
    }
    lock(w).apply(msg);
}

/// Asks `addr` for the batches `from..until` and applies them in order; returns how many.
pub async fn fetch(
    addr: &str,
    from: u64,
    until: u64,
    topic: &[u8],
    w: &Mutex<Writer>,
) -> Result<u64, String> {
    let work = async {
        let mut s = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| format!("cannot connect within {} s", CONNECT_TIMEOUT.as_secs()))?
            .map_err(|e| format!("cannot connect: {e}"))?;
        let _ = s.set_nodelay(true);
        zmtp::handshake(&mut s, "DEALER", &["ROUTER"])
            .await
            .map_err(|e| e.to_string())?;
        s.write_all(&zmtp::message(&[b"", &from.to_be_bytes()]))
            .await
            .map_err(|e| format!("request: {e}"))?;
        let mut budget = MAX_REPLAY_BYTES;
        let mut applied = 0u64;
        let mut last: Option<u64> = None;
        for _ in 0..MAX_REPLAY_MESSAGES {
            let parts = read_message(&mut s, &mut budget)
                .await
                .map_err(|e| e.to_string())?;
            let [empty, seq, payload] = &parts[..] else {
                return Err(format!("an answer of {} frames, not 3", parts.len()));
            };
            let seq = <[u8; 8]>::try_from(&seq[..])
                .map(u64::from_be_bytes)
                .map_err(|_| format!("a sequence number of {} bytes", seq.len()))?;
            if !empty.is_empty() {
                return Err("an answer without its empty delimiter".into());
            }
            if seq == END {
                return Ok(applied);
            }
            if last.is_some_and(|l| seq <= l) {
                return Err(format!(
                    "sequence {seq} after {}: out of order",
                    last.unwrap_or(0)
                ));
            }
            last = Some(seq);
            if seq < from {
                continue;
            }
            if seq >= until {
                return Ok(applied);
            }
            let m = decode(&[topic, &seq.to_be_bytes()[..], payload])
                .map_err(|e| format!("batch {seq}: {e}"))?;
            lock(w).apply(&m);
            applied += 1;
            if seq + 1 == until {
                // Everything missing is in: the rest comes live.
                return Ok(applied);
            }
        }
        Err(format!("more than {MAX_REPLAY_MESSAGES} messages"))
    };
    match tokio::time::timeout(REPLAY_DEADLINE, work).await {
        Ok(r) => r.map_err(|e| format!("replay tcp://{addr}: {e}")),
        Err(_) => Err(format!(
            "replay tcp://{addr}: not finished within {} s",
            REPLAY_DEADLINE.as_secs()
        )),
    }
}

/// One whole message's frames (commands skipped), each frame at most a batch's bound and all of
/// them within what is left of `budget`.
async fn read_message<R: AsyncRead + Unpin>(
    r: &mut R,
    budget: &mut u64,
) -> Result<Vec<Vec<u8>>, ZmtpError> {
    let mut parts = Vec::new();
    loop {
        let max = (*budget).min(MAX_PAYLOAD as u64 + 64);
        let f = zmtp::read_frame(r, max).await?;
        *budget -= f.body.len() as u64;
        if f.is_command() {
            continue;
        }
        let more = f.more();
        parts.push(f.body);
        if !more {
            return Ok(parts);
        }
        if parts.len() >= MAX_PARTS {
            return Err(ZmtpError::TooManyParts(MAX_PARTS));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_message_over_the_budget_is_refused_from_its_header() {
        let big = zmtp::message(&[b"", &[0u8; 8], &[7u8; 300]]);
        let mut budget = 100;
        let e = read_message(&mut &big[..], &mut budget).await.unwrap_err();
        assert!(matches!(e, ZmtpError::TooBig(300, _)), "{e}");
        let mut budget = 1000;
        let parts = read_message(&mut &big[..], &mut budget).await.unwrap();
        assert_eq!((parts.len(), budget), (3, 1000 - 308));
    }
}
