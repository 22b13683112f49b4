//! TLS on both sides, over real sockets with certificates made here: the front door and the
//! admin listener over HTTPS (HTTP/1.1 and h2 by ALPN), the gRPC front door over TLS, an
//! `https://` engine, mTLS to an engine, a certificate rotated on disk, and bad certificates.
//!
//! By side: [`listeners`] (rankgate's own listeners) and [`engines`] (TLS toward engines), over
//! [`helpers`].

#[path = "../common/mod.rs"]
mod common;
mod engines;
mod helpers;
mod listeners;
