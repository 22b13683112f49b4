//! What the front door tells clients and whom it believes: `server.expose_worker` (what a client
//! learns about the engine that served it) and `server.trusted_proxies` (whose `X-Forwarded-*`
//! headers are kept). Both default to the closed choice, as nginx and Envoy do: no upstream
//! address in any answer, and no forwarding header believed from a stranger.

use std::net::IpAddr;

use serde::Deserialize;

use super::error::{invalid, ConfigError};

/// `server.expose_worker`: what a client is told of the engine that served (or failed) it, in
/// the `x-rankgate-worker` header, gRPC metadata and error answers. Operators keep the full
/// detail whatever it says: the access log, `x-rankgate-debug` (admin token) and `/workers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExposeWorker {
    /// Nothing: no worker header, and error answers name no engine, address or setting.
    #[default]
    None,
    /// The engine's configured `name` with the rank (`prefill-a@1`); nothing for an engine
    /// without a name. Error answers otherwise as with `none`.
    Name,
    /// The engine's URL with the rank (`http://10.0.0.7:8000@1`), and error answers with their
    /// whole detail (addresses, the setting that decided): for tests, demos and closed networks.
    Url,
}

pub const DEFAULT_EXPOSE_WORKER: ExposeWorker = ExposeWorker::None;

/// Longest `engines[].name`: it is sent in a header on every answer.
pub const MAX_ENGINE_NAME_BYTES: usize = 64;

/// Whether `name` can be an engine's name (see [`check_engine_name`]).
pub fn engine_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_ENGINE_NAME_BYTES
        && name.bytes().all(|b| b.is_ascii_graphic() && b != b'@')
}

/// Checks an engine's `name`: 1 to 64 visible ASCII characters without `@` (the rank follows
/// one), so that it can be a header value as it is.
pub fn check_engine_name(key: &str, name: &str) -> Result<(), ConfigError> {
    match engine_name_ok(name) {
        true => Ok(()),
        false => Err(invalid(
            key,
            format!("{name:?} must be 1 to {MAX_ENGINE_NAME_BYTES} visible ASCII characters, without spaces or `@`"),
        )),
    }
}

/// One `server.trusted_proxies` entry: an address block (`10.0.0.0/8`, `fd00::/8`, or one
/// address, which is a block of one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    net: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Parses `addr[/prefix]`; the address's bits beyond the prefix must be zero (a block
    /// written with host bits is usually a typo for another block).
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let (addr, prefix) = match s.trim().split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s.trim(), None),
        };
        let net: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?} is not an IP address or a CIDR block"))?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => match p.parse::<u8>() {
                Ok(p) if p <= max => p,
                _ => return Err(format!("{s:?}: the prefix length must be 0 to {max}")),
            },
        };
        let cidr = Cidr { net, prefix };
        if cidr.masked(net) != bits(net) {
            return Err(format!(
                "{s:?} has address bits set beyond its /{prefix} prefix"
            ));
        }
        Ok(cidr)
    }

    /// Whether `ip` is in the block. An IPv4 client of a dual-stack listener (`::ffff:a.b.c.d`)
    /// is matched as its IPv4 address.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        ip.is_ipv4() == self.net.is_ipv4() && self.masked(ip) == bits(self.net)
    }

    fn masked(&self, ip: IpAddr) -> u128 {
        let width = if ip.is_ipv4() { 32 } else { 128 };
        let keep = u32::from(self.prefix);
        let mask = match keep {
            0 => 0,
            k => u128::MAX << (width - k) & (u128::MAX >> (128 - width)),
        };
        bits(ip) & mask
    }
}

fn bits(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v) => u128::from(u32::from(v)),
        IpAddr::V6(v) => u128::from(v),
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.net, self.prefix)
    }
}

/// `server.trusted_proxies` as written, each entry parsed; errors name the entry.
pub(super) fn trusted_proxies(raw: Option<Vec<String>>) -> Result<Vec<Cidr>, ConfigError> {
    (raw.unwrap_or_default().iter().enumerate())
        .map(|(i, s)| {
            Cidr::parse(s).map_err(|p| invalid(format!("server.trusted_proxies[{i}]"), p))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn blocks_match_their_addresses_only() {
        let c = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(c.contains(ip("10.255.1.2")));
        assert!(!c.contains(ip("11.0.0.1")));
        assert!(c.contains(ip("::ffff:10.1.2.3")), "a mapped IPv4 client");
        assert!(!c.contains(ip("::1")));
        let one = Cidr::parse("127.0.0.2").unwrap();
        assert!(one.contains(ip("127.0.0.2")) && !one.contains(ip("127.0.0.1")));
        let all = Cidr::parse("0.0.0.0/0").unwrap();
        assert!(all.contains(ip("1.2.3.4")) && !all.contains(ip("::2")));
        let v6 = Cidr::parse("fd00::/8").unwrap();
        assert!(v6.contains(ip("fd12::1")) && !v6.contains(ip("fe80::1")));
        assert!(Cidr::parse("::/0").unwrap().contains(ip("2001:db8::1")));
    }

    #[test]
    fn bad_blocks_are_refused() {
        for bad in [
            "",
            "10.0.0.0/33",
            "10.0.0.1/8",
            "nope",
            "10.0.0.0/x",
            "::/129",
        ] {
            assert!(Cidr::parse(bad).is_err(), "{bad:?}");
        }
        let err = trusted_proxies(Some(vec!["10.0.0.0/8".into(), "x".into()])).unwrap_err();
        assert!(
            err.to_string().contains("server.trusted_proxies[1]"),
            "{err}"
        );
    }

    #[test]
    fn engine_names_are_header_safe() {
        assert!(check_engine_name("engines[0].name", "prefill-a").is_ok());
        for bad in ["", "has space", "a@b", &"x".repeat(65), "caf\u{e9}"] {
            assert!(
                check_engine_name("engines[0].name", bad).is_err(),
                "{bad:?}"
            );
        }
    }
}
