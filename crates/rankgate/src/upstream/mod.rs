//! The way to the engines, below both the fleet (each engine entry holds its connections) and
//! the proxy (which sends on them): per-engine connection state, idle connections, and the
//! request body as it goes out.

pub mod conn;
pub mod cutoff;
pub mod idle;
pub mod request;

/// The most an engine's answer head (status line and headers) may take, over HTTP/1 and h2
/// alike: a larger one is refused as a broken answer (502), never passed to a client. An
/// engine's usual head is well under 1 KiB; hyper's own defaults allow ~400 KiB (HTTP/1) and
/// 16 MiB (h2).
pub const MAX_ENGINE_HEADER_BYTES: usize = 64 * 1024;

/// An HTTP/1 connection to an engine over `io`, its answer heads bounded by
/// [`MAX_ENGINE_HEADER_BYTES`]: a larger one fails as a parse error ("message head is too
/// large"), a 502 with that reason in the error log.
pub async fn handshake<T>(
    io: T,
) -> hyper::Result<(
    hyper::client::conn::http1::SendRequest<RequestBody>,
    hyper::client::conn::http1::Connection<T, RequestBody>,
)>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    hyper::client::conn::http1::Builder::new()
        .max_buf_size(MAX_ENGINE_HEADER_BYTES)
        .handshake(io)
        .await
}

pub use conn::{ConnLimits, EngineConn, Slots, Streams, MAX_GRPC_CONNECTIONS};
pub use cutoff::{CutConnector, CutIo, Cutoff};
pub use idle::{Idle, Sender};
pub use request::{BodyPace, BodyTooLarge, BoxError, ClientBodyError, RequestBody, StreamBody};
