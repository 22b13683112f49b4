//! DNS discovery against a real DNS server: an in-process authoritative server (hickory-server)
//! on a UDP socket bound to 127.0.0.1:0, answering A/AAAA for one name from state each test
//! changes at runtime, including answering SERVFAIL or not at all.
//!
//! By part: [`lookups`] (the task) and [`router`] (a router's fleet), over [`dns_server`] and
//! [`helpers`].

#[path = "../common/mod.rs"]
mod common;
mod dns_server;
mod helpers;
mod lookups;
mod router;
