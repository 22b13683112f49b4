//! The way to the engines, below both the fleet (each engine entry holds its connections) and
//! the proxy (which sends on them): per-engine connection state, idle connections, and the
//! request body as it goes out.

pub mod conn;
pub mod cutoff;
pub mod idle;
pub mod request;

pub use conn::{ConnLimits, EngineConn, Slots, Streams, MAX_GRPC_CONNECTIONS};
pub use cutoff::{CutConnector, CutIo, Cutoff};
pub use idle::{Idle, Sender};
pub use request::{BodyPace, BodyTooLarge, BoxError, ClientBodyError, RequestBody, StreamBody};
