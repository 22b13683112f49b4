//! What the client fault tests share: one HTTP/1.1 response read from a raw connection.

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Reads one HTTP/1 response with a Content-Length body and returns it as text.
pub async fn read_response(s: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "closed mid-response: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
        let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map(|v| v.trim().parse().unwrap())
            .expect("content-length");
        if got.len() >= end + 4 + len {
            return String::from_utf8_lossy(&got).into_owned();
        }
    }
}
