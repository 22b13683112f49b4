//! A hostile client for `bench/hostile/floods.sh`, loopback only, every loop bounded in count
//! and time.
//!
//! `flood TARGET FROM KIND COUNT SECONDS MAX_CONNECTS`: from one source address, keeps up to `--count` connections open to `--target`,
//! each saying only what its kind says (`idle`: nothing; `h2-preface`: the 24-byte HTTP/2
//! preface; `tls-half`: the first bytes of a TLS ClientHello record; `one-request`: one cheap
//! `GET /nope`, its answer read, then nothing), opening a new one for
//! each the server closes, for `--seconds` and at most `--max-connects` connects in all.
//! Prints one line: `connects=N closed_by_server=N held_max=N connect_errors=N`. (The good
//! client the script measures alongside is curl, from another address.)
//!
//! Usage: flood flood TARGET FROM KIND COUNT SECONDS MAX_CONNECTS

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::Semaphore;

/// Connects in progress at once: the kernel's SYN backlog, not the client, should be the limit.
const CONNECTING: usize = 512;

fn usage() -> ! {
    eprintln!(
        "usage: flood flood TARGET FROM KIND(idle|h2-preface|tls-half|one-request) COUNT SECONDS MAX_CONNECTS"
    );
    std::process::exit(2)
}

fn arg<T: std::str::FromStr>(args: &[String], i: usize) -> T {
    args.get(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| usage())
}

async fn connect(from: IpAddr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(from, 0))?;
    socket.connect(to).await
}

fn first_bytes(kind: &str) -> &'static [u8] {
    match kind {
        "idle" => b"",
        "h2-preface" => b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        // A handshake record announcing 512 bytes, and the first 4 of a ClientHello.
        "tls-half" => &[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc],
        // Keep-alive: the answer comes, then the socket idles between requests.
        "one-request" => b"GET /nope HTTP/1.1\r\nhost: flood\r\n\r\n",
        _ => usage(),
    }
}

#[derive(Default)]
struct Counts {
    connects: AtomicU64,
    closed: AtomicU64,
    held: AtomicU64,
    held_max: AtomicU64,
    errors: AtomicU64,
}

async fn flood(args: &[String]) {
    let target: SocketAddr = arg(args, 2);
    let from: IpAddr = arg(args, 3);
    let bytes = first_bytes(args.get(4).map_or("", String::as_str));
    let count: usize = arg(args, 5);
    let seconds: u64 = arg(args, 6);
    let max_connects: u64 = arg(args, 7);
    let end = tokio::time::Instant::now() + Duration::from_secs(seconds);
    let counts = Arc::new(Counts::default());
    let connecting = Arc::new(Semaphore::new(CONNECTING));
    let mut tasks = tokio::task::JoinSet::new();
    // Each task keeps one connection open, opening another when the server closes it.
    for _ in 0..count {
        let (counts, connecting) = (counts.clone(), connecting.clone());
        tasks.spawn(async move {
            while tokio::time::Instant::now() < end && counts.connects.load(Relaxed) < max_connects
            {
                let Ok(permit) = connecting.acquire().await else {
                    return;
                };
                counts.connects.fetch_add(1, Relaxed);
                let s = tokio::time::timeout_at(end, connect(from, target)).await;
                drop(permit);
                let mut s = match s {
                    Ok(Ok(s)) => s,
                    Ok(Err(_)) => {
                        counts.errors.fetch_add(1, Relaxed);
                        // Out of ports or descriptors: back off a little, bounded by `end`.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    Err(_) => return,
                };
                if !bytes.is_empty() && s.write_all(bytes).await.is_err() {
                    counts.closed.fetch_add(1, Relaxed);
                    continue;
                }
                let held = counts.held.fetch_add(1, Relaxed) + 1;
                counts.held_max.fetch_max(held, Relaxed);
                let mut buf = [0u8; 512];
                // Read (and drop) what the server says until it closes, or the flood ends.
                let closed = tokio::time::timeout_at(end, async {
                    loop {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) => {}
                        }
                    }
                })
                .await;
                counts.held.fetch_sub(1, Relaxed);
                if closed.is_ok() {
                    counts.closed.fetch_add(1, Relaxed);
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    println!(
        "connects={} closed_by_server={} held_max={} connect_errors={}",
        counts.connects.load(Relaxed),
        counts.closed.load(Relaxed),
        counts.held_max.load(Relaxed),
        counts.errors.load(Relaxed)
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| {
            eprintln!("runtime: {e}");
            std::process::exit(1)
        });
    match args.get(1).map(String::as_str) {
        Some("flood") => rt.block_on(flood(&args)),
        _ => usage(),
    }
}
