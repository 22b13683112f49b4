//! Whether a client takes what is sent to it, as its TCP socket tells (Linux `TCP_INFO`): the
//! bytes it has acknowledged, and whether any wait for it. The kernel accepts writes into the
//! socket's send buffer long after the client stopped reading (a buffer that grows to hundreds
//! of KB on a fast path), so a write that waits comes late; an acknowledged count that stays put
//! while bytes wait says at once that the client takes nothing. Read by the connection watch a
//! few times per `send_timeout`, never on the request path.

/// What the client's socket says: its acknowledged byte count, and whether bytes wait for it
/// (sent and not acknowledged, or not sent yet). `None`: not a TCP socket, or not Linux.
pub(super) fn look(fd: i32) -> Option<(u64, bool)> {
    look_linux(fd)
}

#[cfg(target_os = "linux")]
fn look_linux(fd: i32) -> Option<(u64, bool)> {
    if fd < 0 {
        return None;
    }
    // SAFETY: an all-zero tcp_info is a valid value of this plain C struct.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `info`, which is that large; a closed
    // or foreign descriptor only makes it fail.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    // A kernel older than the fields read (4.2 for the acknowledged count) says nothing.
    let needed = std::mem::offset_of!(libc::tcp_info, tcpi_bytes_acked) + 8;
    if r != 0 || (len as usize) < needed {
        return None;
    }
    let waiting = info.tcpi_unacked > 0 || info.tcpi_notsent_bytes > 0;
    Some((info.tcpi_bytes_acked, waiting))
}

#[cfg(not(target_os = "linux"))]
fn look_linux(_fd: i32) -> Option<(u64, bool)> {
    None
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsRawFd;

    #[test]
    #[cfg(target_os = "linux")]
    fn a_peer_that_reads_nothing_leaves_bytes_waiting_and_the_count_still() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut out = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_peer, _) = listener.accept().unwrap();
        let (acked, waiting) = super::look(out.as_raw_fd()).expect("a TCP socket");
        assert!(!waiting, "nothing sent yet");
        out.set_nonblocking(true).unwrap();
        let chunk = [7u8; 64 * 1024];
        // Bounded: the peer's buffer and ours fill well within this.
        for _ in 0..1000 {
            if out.write(&chunk).is_err() {
                break;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        let (later, waiting) = super::look(out.as_raw_fd()).unwrap();
        assert!(waiting, "bytes wait for a peer that reads nothing");
        assert!(
            later > acked,
            "what the peer's buffer took was acknowledged"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(
            super::look(out.as_raw_fd()).unwrap().0,
            later,
            "then nothing more"
        );
        assert!(super::look(-1).is_none());
    }
}
