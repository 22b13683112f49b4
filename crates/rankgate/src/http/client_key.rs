//! What a client connection counts against in `max_connections_per_client`: its address for
//! IPv4, its `server.client_ipv6_prefix` (a /64 by default) for IPv6. One IPv6 host is commonly
//! given a whole /64: counted address by address, one host could open its limit from each of
//! billions of addresses. An IPv4-mapped IPv6 address (`::ffff:a.b.c.d`, what a dual-stack
//! socket shows an IPv4 peer as) is the IPv4 client it stands for.

use std::net::{IpAddr, Ipv6Addr};

/// The key `ip` is counted under, with IPv6 addresses cut to their first `ipv6_prefix` bits
/// (clamped to 0..=128; the config allows 1..=128).
pub(crate) fn client_key(ip: IpAddr, ipv6_prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let keep = u32::from(ipv6_prefix.min(128));
                // A shift by 128 overflows: a prefix of 0 keeps nothing.
                let mask = u128::MAX.checked_shl(128 - keep).unwrap_or(0);
                IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask))
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v6(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn ipv4_counts_per_address() {
        let a = v6("192.0.2.7");
        assert_eq!(client_key(a, 64), a);
        assert_eq!(client_key(a, 1), a);
        assert_ne!(client_key(a, 64), client_key(v6("192.0.2.8"), 64));
    }

    #[test]
    fn ipv6_counts_per_prefix() {
        let (a, b) = (v6("2001:db8:1:2:aaaa::1"), v6("2001:db8:1:2:ffff:1:2:3"));
        assert_eq!(client_key(a, 64), v6("2001:db8:1:2::"));
        assert_eq!(client_key(a, 64), client_key(b, 64));
        // The next /64 is another client.
        assert_ne!(client_key(a, 64), client_key(v6("2001:db8:1:3::1"), 64));
        // 128: each address apart.
        assert_eq!(client_key(a, 128), a);
        assert_ne!(client_key(a, 128), client_key(b, 128));
        // Prefixes that do not fall on a group boundary.
        assert_eq!(client_key(v6("2001:db8:ffff::"), 36), v6("2001:db8:f000::"));
        assert_eq!(client_key(v6("ffff::1"), 1), v6("8000::"));
        assert_eq!(client_key(v6("::1"), 127), v6("::"));
        assert_eq!(client_key(v6("2001:db8::1"), 0), v6("::"));
    }

    #[test]
    fn ipv4_mapped_ipv6_counts_as_ipv4() {
        let mapped = v6("::ffff:192.0.2.7");
        assert_eq!(client_key(mapped, 64), v6("192.0.2.7"));
        assert_eq!(client_key(mapped, 128), v6("192.0.2.7"));
        // Two IPv4 clients behind mapped addresses stay two, whatever the prefix.
        assert_ne!(
            client_key(mapped, 64),
            client_key(v6("::ffff:192.0.2.8"), 64)
        );
        // Loopback ::1 is not IPv4.
        assert!(client_key(v6("::1"), 128).is_ipv6());
    }
}
