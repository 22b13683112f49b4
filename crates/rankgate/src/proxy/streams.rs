//! Requests in flight per client address, under `server.max_streams_per_client`: one address
//! (a flood, or clients that stop reading) must not hold more of the fleet than a share well
//! below what one engine can take.
//!
//! The count is a fixed table of counters indexed by a hash of the client's address (an IPv6
//! address by its /64, which one host may hold whole), computed once per connection
//! ([`client_key`]): a request costs one atomic add and one subtract (and its connection
//! handle's reference, which its guard holds), and no map, lock or allocation. Two addresses
//! whose hashes meet share one count; with [`BUCKETS`] counters that is rare, and then they
//! share a cap that is already generous for one. The hash is keyed with a key drawn at start:
//! with one anybody could compute, an attacker holding many addresses (an IPv6 /48 holds 65,536
//! /64s, more than the counters) could pick one that meets a victim's and hold its place.

use std::hash::{BuildHasher, RandomState};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::OnceLock;

/// Counters in the table: a power of two.
pub const BUCKETS: usize = 1 << 14;

/// The counts of requests in flight per client address.
#[derive(Debug)]
pub struct ClientStreams {
    /// Requests one address may have in flight at once.
    pub limit: u32,
    counts: Box<[AtomicU32]>,
}

impl ClientStreams {
    pub fn new(limit: usize) -> ClientStreams {
        ClientStreams {
            limit: u32::try_from(limit).unwrap_or(u32::MAX),
            counts: (0..BUCKETS).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// Counts one more request for the client `key`, unless it is at its limit.
    #[inline]
    pub fn take(&self, key: u32) -> bool {
        let c = &self.counts[bucket(key)];
        if c.fetch_add(1, Relaxed) >= self.limit {
            c.fetch_sub(1, Relaxed);
            return false;
        }
        true
    }

    #[inline]
    pub fn give_back(&self, key: u32) {
        self.counts[bucket(key)].fetch_sub(1, Relaxed);
    }

    /// Requests in flight for the client `key` now.
    #[cfg(test)]
    fn of(&self, key: u32) -> u32 {
        self.counts[bucket(key)].load(Relaxed)
    }
}

fn bucket(key: u32) -> usize {
    (key >> (32 - BUCKETS.trailing_zeros())) as usize
}

/// The client's key, from its address (IPv4, or an IPv6 address's /64), once per connection:
/// the high 16 bits (which index [`ClientStreams`]) hashed with this process's key (SipHash),
/// the low 16 bits (an engine's share table, 64 buckets, which any 64 addresses cover whatever
/// the hash) by Fibonacci hashing, so that neighbouring addresses never share a bucket there.
pub fn client_key(ip: IpAddr) -> u32 {
    static KEY: OnceLock<RandomState> = OnceLock::new();
    let bits: u64 = match ip.to_canonical() {
        IpAddr::V4(v4) => u64::from(u32::from(v4)),
        IpAddr::V6(v6) => (u128::from(v6) >> 64) as u64 | (1 << 63),
    };
    let keyed = (KEY.get_or_init(RandomState::new).hash_one(bits) >> 48) as u32;
    let spread = (bits.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32;
    (keyed << 16) | (spread & 0xFFFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_past_its_limit_is_refused_and_others_are_not() {
        let s = ClientStreams::new(2);
        let a = client_key("10.0.0.1".parse().unwrap());
        // Another address with a counter of its own (the key is drawn at start: two of them
        // may meet, rarely).
        let b = (2..=20)
            .map(|i| client_key(IpAddr::from([10, 0, 0, i])))
            .find(|&b| bucket(b) != bucket(a))
            .expect("an address with another counter");
        assert!(s.take(a) && s.take(a));
        assert!(!s.take(a), "at its limit");
        assert_eq!(s.of(a), 2, "a refusal leaves the count as it was");
        assert!(s.take(b), "another address is not held back");
        s.give_back(a);
        assert!(s.take(a));
    }

    #[test]
    fn an_ipv6_host_is_one_client_by_its_64() {
        let a = client_key("2001:db8:1:2::1".parse().unwrap());
        let b = client_key("2001:db8:1:2:ffff::9".parse().unwrap());
        let c = client_key("2001:db8:1:3::1".parse().unwrap());
        assert_eq!(a, b);
        assert_ne!(a, c);
        let mapped = client_key("::ffff:10.0.0.1".parse().unwrap());
        assert_eq!(mapped, client_key("10.0.0.1".parse().unwrap()));
    }
}
