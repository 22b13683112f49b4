//! The listening sockets of rankgate's doors: how many connections the kernel may queue for
//! each, and that it hands over only connections that have spoken.

use std::net::SocketAddr;

use tokio::net::TcpListener;

/// Connections the kernel queues for a listener before it drops SYNs (capped by
/// `net.core.somaxconn`). `TcpListener::bind` asks for 128: a burst of new clients, or the wait
/// while accepting is paused at `max_connections`, then overflows it and clients stall for a
/// SYN retry (1 s, then 2 s, ...).
const LISTEN_BACKLOG: u32 = 4096;

/// Whether a listener shares its port with others (`SO_REUSEPORT`: the kernel spreads new
/// connections among them; thread-per-core's one per core).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Share {
    /// Its port alone.
    No,
    /// The first of a shared port: bound alone, so a port anyone holds is an error (two
    /// rankgates would otherwise both start on one port and split its traffic), then opened to
    /// [`Share::Join`]ers before it listens. Bound, dropped and bound again shared, the port
    /// was free for a moment, and another socket could take it (a test's, now and then).
    Lead,
    /// Another listener on a [`Share::Lead`]er's port.
    Join,
}

/// A listening socket on `addr`, sharing its port as `share` says.
pub fn listen(addr: SocketAddr, share: Share) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    }?;
    socket.set_reuseaddr(true)?;
    if share == Share::Join {
        socket.set_reuseport(true)?;
    }
    socket.bind(addr)?;
    if share == Share::Lead {
        // Before it listens: a listener joins its port's group of shared ones when it starts
        // listening.
        socket.set_reuseport(true)?;
    }
    defer_accept(&socket)?;
    socket.listen(LISTEN_BACKLOG)
}

/// The kernel keeps a connection that has sent nothing out of the accept queue for 10 s
/// (`TCP_DEFER_ACCEPT`; rounded up to its SYN-ACK retries, about 15 s). Every protocol served
/// here has the client speak first (an HTTP head, a TLS hello, the h2 preface), so a real client
/// is accepted with its first bytes, at once, while a flood of sockets that never speak waits in
/// the kernel instead of the accept queue: a client from another address is no longer queued
/// behind thousands of them (nginx's `deferred`). A TCP-only check (a Kubernetes `tcpSocket`
/// probe) still connects: the handshake completes on its side.
#[cfg(target_os = "linux")]
fn defer_accept(socket: &tokio::net::TcpSocket) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let secs: libc::c_int = 10;
    // SAFETY: setsockopt on a socket this function borrows, with a c_int the call reads only.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            (&secs as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    match rc {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

#[cfg(not(target_os = "linux"))]
fn defer_accept(_: &tokio::net::TcpSocket) -> std::io::Result<()> {
    Ok(())
}
