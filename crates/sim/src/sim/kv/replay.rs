//! A rank's replay socket, as vLLM's publisher serves it with `replay_endpoint`: the rank keeps
//! its last `buffer_steps` batches, and a ZeroMQ ROUTER (bound at the endpoint's port + the
//! rank, or a free port with port 0) answers a request of two frames (an empty delimiter and
//! the first sequence number wanted, 8 bytes big-endian) with one message per buffered batch
//! from there, `[empty, sequence, payload]` (no topic), then the end marker `[empty, -1 as 8
//! bytes, empty]`. Several requests may follow on one connection.
//!
//! Bounded: the buffer holds at most `buffer_steps` batches (and [`MAX_BUFFER_BYTES`]), at most
//! [`MAX_CLIENTS`] clients are served at once, and a client's request frames are small or the
//! connection is closed.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::zmtp::{self, ZmtpError};

/// Bytes of payload a rank's buffer keeps at most, whatever `buffer_steps` says.
const MAX_BUFFER_BYTES: usize = 256 << 20;
/// Replay clients served at once per rank.
const MAX_CLIENTS: usize = 16;
/// A request's frames are a delimiter and 8 bytes: anything bigger is not a request.
const MAX_REQUEST_FRAME: u64 = 64;

/// The end marker's sequence: -1 as a signed 64-bit big-endian integer.
const END: [u8; 8] = [0xff; 8];

/// A rank's recent batches, oldest first.
#[derive(Debug)]
pub(crate) struct Buffer {
    batches: Mutex<VecDeque<(u64, Bytes)>>,
    bytes: AtomicUsize,
    steps: usize,
}

impl Buffer {
    pub(crate) fn new(steps: u64) -> Buffer {
        Buffer {
            batches: Mutex::new(VecDeque::new()),
            bytes: AtomicUsize::new(0),
            steps: usize::try_from(steps).unwrap_or(usize::MAX),
        }
    }

    pub(crate) fn push(&self, seq: u64, payload: Bytes) {
        let mut b = lock(&self.batches);
        let mut bytes = self.bytes.load(Relaxed) + payload.len();
        b.push_back((seq, payload));
        while b.len() > self.steps || (bytes > MAX_BUFFER_BYTES && b.len() > 1) {
            if let Some((_, old)) = b.pop_front() {
                bytes -= old.len();
            }
        }
        self.bytes.store(bytes, Relaxed);
    }

    /// The engine restarted: what it buffered went with the old process.
    pub(crate) fn clear(&self) {
        lock(&self.batches).clear();
        self.bytes.store(0, Relaxed);
    }

    fn from(&self, start: u64) -> Vec<(u64, Bytes)> {
        (lock(&self.batches).iter())
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect()
    }
}

/// Binds the rank's replay socket and serves it until `stop`; returns the address bound.
pub(crate) async fn start(
    at: SocketAddr,
    buffer: Arc<Buffer>,
    stop: watch::Receiver<bool>,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(at).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(accept(listener, buffer, stop));
    Ok(addr)
}

async fn accept(listener: TcpListener, buffer: Arc<Buffer>, mut stop: watch::Receiver<bool>) {
    let clients = Arc::new(tokio::sync::Semaphore::new(MAX_CLIENTS));
    loop {
        let conn = tokio::select! {
            c = listener.accept() => c,
            _ = stop.wait_for(|s| *s) => return,
        };
        let Ok((stream, _)) = conn else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Ok(slot) = clients.clone().try_acquire_owned() else {
            continue; // dropped: closed
        };
        let buffer = buffer.clone();
        let mut stop = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                r = serve(stream, &buffer) => {
                    if let Err(e) = r {
                        tracing::debug!("kv replay client gone: {e}");
                    }
                }
                _ = stop.wait_for(|s| *s) => {}
            }
            drop(slot);
        });
    }
}

/// Serves one client's requests until it goes.
async fn serve(mut s: TcpStream, buffer: &Buffer) -> Result<(), ZmtpError> {
    let _ = s.set_nodelay(true);
    zmtp::handshake(&mut s, "ROUTER", &["DEALER", "REQ", "ROUTER"]).await?;
    loop {
        let mut parts = Vec::new();
        loop {
            let f = zmtp::read_frame(&mut s, MAX_REQUEST_FRAME).await?;
            if f.is_command() {
                continue;
            }
            let more = f.more();
            parts.push(f.body);
            if !more {
                break;
            }
            if parts.len() >= 4 {
                return Err(ZmtpError::TooManyParts(4));
            }
        }
        // As vLLM: anything but [empty, start] is ignored (logged there).
        let [empty, start] = &parts[..] else { continue };
        if !empty.is_empty() {
            continue;
        }
        let mut n = [0u8; 8];
        let k = start.len().min(8);
        n[8 - k..].copy_from_slice(&start[start.len() - k..]);
        let start = u64::from_be_bytes(n);
        for (seq, payload) in buffer.from(start) {
            s.write_all(&zmtp::message(&[b"", &seq.to_be_bytes(), &payload]))
                .await?;
        }
        s.write_all(&zmtp::message(&[b"", &END, b""])).await?;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_buffer_keeps_its_last_steps() {
        let b = Buffer::new(3);
        for s in 0..5 {
            b.push(s, Bytes::from_static(b"x"));
        }
        let seqs: Vec<u64> = b.from(0).iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, [2, 3, 4]);
        assert_eq!(b.from(4).len(), 1);
        b.clear();
        assert!(b.from(0).is_empty());
    }
}
