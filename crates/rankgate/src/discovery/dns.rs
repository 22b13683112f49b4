//! DNS discovery: the task behind one `kind = "dns"` entry. Every `interval` it asks for the A
//! and AAAA records of the entry's name, turns each address into an engine, and reports the
//! whole set on its channel when it differs from the set last reported.
//!
//! What the answer means is the point of this module, because a wrong reading empties a fleet:
//! - an answer with records: those addresses are the engines;
//! - an answer that the name has no such records (NXDOMAIN, or NOERROR with no answer, i.e.
//!   NODATA): that family has no engines. Both families so answered is an empty set, and the
//!   engines leave: a headless Service scaled to zero looks exactly like this;
//! - anything else (timeout, SERVFAIL, REFUSED, connection refused, no `/etc/resolv.conf`): the
//!   resolver could not look, so nothing is reported and the fleet keeps what was last found.
//!   One family failing fails the whole round, so an IPv6 outage does not drop the IPv6 engines.
//!
//! That is why A and AAAA are asked separately rather than with hickory's dual-stack
//! `lookup_ip`: it returns whichever family answered and drops the other's error, which would
//! read "AAAA timed out, A has no records" as an empty fleet.
//!
//! With the system configuration a name without a trailing dot goes through resolv.conf's
//! search list, and the last name tried decides; a fully qualified name
//! (`vllm.ns.svc.cluster.local.`) is asked as written, once per family.
//!
//! TTLs are not honoured: the resolver keeps no cache, so a record that vanishes is gone at the
//! next round instead of when its TTL runs out.

use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::time::Duration;

use hickory_resolver::config::{NameServerConfigGroup, ResolveHosts, ResolverConfig, ResolverOpts};
use hickory_resolver::lookup::Lookup;
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::proto::op::ResponseCode;
use hickory_resolver::proto::rr::{RData, RecordType};
use hickory_resolver::proto::ProtoErrorKind;
use hickory_resolver::{Name, ResolveError, TokioResolver};
use tokio::time::MissedTickBehavior;

use super::found::{DiscoveryError, Found};
use crate::config::{Discovery, DiscoverySource};
use crate::http::{shutdown_signalled, Shutdown};
use crate::worker::Engine;

/// Query timeouts follow the interval (a 100ms interval should not wait 5s on a lost packet)
/// but stay within these: under a second spuriously fails a remote resolver, over 5s (the
/// resolv.conf default) only delays noticing an outage.
const MIN_QUERY_TIMEOUT: Duration = Duration::from_secs(1);
const MAX_QUERY_TIMEOUT: Duration = Duration::from_secs(5);
/// Retries per query (hickory's `attempts` counts retries, not tries): one absorbs a lost UDP
/// packet without logging an outage, and a dead server fails the round after two timeouts.
const RETRIES: usize = 1;
/// A round is cut after this many query timeouts: both tries of a name and slack. A search
/// list whose every name times out would take longer; it fails either way.
const ROUND_TIMEOUTS: u32 = 4;

/// Why one round found nothing to report.
#[derive(Debug, thiserror::Error)]
enum RoundError {
    #[error("cannot set up the resolver: {0}")]
    Setup(#[source] ResolveError),
    #[error("{family} lookup failed: {}", why(source))]
    Lookup {
        family: RecordType,
        #[source]
        source: ResolveError,
    },
    #[error("no answer within {0:?}")]
    TimedOut(Duration),
}

/// Runs the DNS discovery `d` until `shutdown` or until the receiver of `found` is gone,
/// sending each new set of engines on `found`. See the module doc for when a set is sent.
pub async fn run(d: Discovery, found: Found, mut shutdown: Shutdown) {
    let DiscoverySource::Dns {
        name,
        port,
        grpc_port,
        resolver: server,
        interval,
    } = d.source.clone()
    else {
        let e = DiscoveryError::new(&d, "is not a DNS discovery");
        tracing::error!(error = %e, "DNS discovery not started");
        return;
    };
    let name = match Name::from_str(&name) {
        Ok(n) => n,
        Err(why) => {
            let e = DiscoveryError::new(&d, format!("{name:?} is not a DNS name: {why}"));
            tracing::error!(error = %e, "DNS discovery not started");
            return;
        }
    };
    let timeout = query_timeout(interval);
    let round_limit = timeout * ROUND_TIMEOUTS;
    // Built on the first round and rebuilt after a setup failure, so a resolv.conf that appears
    // later (or a transient read error) is picked up without a restart.
    let mut resolver: Option<TokioResolver> = None;
    let mut last: Option<Vec<Engine>> = None;
    let mut outage = Outage::default();
    let mut ticks = tokio::time::interval(interval);
    // A slow round (timeouts) must not be followed by a burst of catch-up rounds.
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown_signalled(&mut shutdown) => return,
            _ = found.closed() => return,
            _ = ticks.tick() => {}
        }
        let lookup = resolve(&mut resolver, server, timeout, &name);
        let round = tokio::select! {
            _ = shutdown_signalled(&mut shutdown) => return,
            _ = found.closed() => return,
            r = tokio::time::timeout(round_limit, lookup) => {
                r.unwrap_or(Err(RoundError::TimedOut(round_limit)))
            }
        };
        let ips = match round {
            Ok(ips) => ips,
            Err(e) => {
                if outage.fail() {
                    tracing::warn!(discovery = %d.at, %name, error = %e, "DNS discovery cannot resolve; keeping the engines last found");
                } else {
                    tracing::debug!(discovery = %d.at, %name, error = %e, "DNS discovery still cannot resolve");
                }
                continue;
            }
        };
        if outage.recover() {
            tracing::info!(discovery = %d.at, %name, addresses = ips.len(), "DNS discovery resolves again");
        }
        let set = engines(&d, port, grpc_port, ips);
        if last.as_ref() == Some(&set) {
            continue;
        }
        tokio::select! {
            _ = shutdown_signalled(&mut shutdown) => return,
            sent = found.send(set.clone()) => if sent.is_err() { return },
        }
        tracing::debug!(discovery = %d.at, %name, engines = set.len(), "DNS discovery found a new set");
        last = Some(set);
    }
}

/// One round: A and AAAA of `name`, both or nothing.
async fn resolve(
    resolver: &mut Option<TokioResolver>,
    server: Option<SocketAddr>,
    timeout: Duration,
    name: &Name,
) -> Result<Vec<IpAddr>, RoundError> {
    let resolver = match resolver {
        Some(r) => r,
        None => resolver.insert(build(server, timeout).map_err(RoundError::Setup)?),
    };
    let (v4, v6) = tokio::join!(
        resolver.lookup(name.clone(), RecordType::A),
        resolver.lookup(name.clone(), RecordType::AAAA)
    );
    let mut ips = answer(v4).map_err(|source| RoundError::Lookup {
        family: RecordType::A,
        source,
    })?;
    ips.extend(answer(v6).map_err(|source| RoundError::Lookup {
        family: RecordType::AAAA,
        source,
    })?);
    Ok(ips)
}

/// A resolver asking only `server` (UDP, TCP when a reply is truncated), or else the system's
/// configuration (`/etc/resolv.conf`: nameservers, search list, ndots, `/etc/hosts`).
fn build(server: Option<SocketAddr>, timeout: Duration) -> Result<TokioResolver, ResolveError> {
    let mut builder = match server {
        Some(addr) => TokioResolver::builder_with_config(
            ResolverConfig::from_parts(
                None,
                vec![],
                NameServerConfigGroup::from_ips_clear(&[addr.ip()], addr.port(), true),
            ),
            TokioConnectionProvider::default(),
        ),
        None => TokioResolver::builder_tokio()?,
    };
    tune(builder.options_mut(), server.is_some(), timeout);
    Ok(builder.build())
}

fn tune(o: &mut ResolverOpts, named_server: bool, timeout: Duration) {
    // No cache, positive or negative: every round asks the server, so a removed record is seen
    // at the next round whatever its TTL.
    o.cache_size = 0;
    o.positive_max_ttl = Some(Duration::ZERO);
    o.negative_max_ttl = Some(Duration::ZERO);
    o.timeout = timeout;
    o.attempts = RETRIES;
    if named_server {
        // The entry names the server to ask; /etc/hosts is not it.
        o.use_hosts_file = ResolveHosts::Never;
    }
}

fn query_timeout(interval: Duration) -> Duration {
    interval.clamp(MIN_QUERY_TIMEOUT, MAX_QUERY_TIMEOUT)
}

/// The addresses in one family's answer; an answer that there are none is `Ok(empty)`, any
/// other failure is `Err` (see the module doc).
fn answer(result: Result<Lookup, ResolveError>) -> Result<Vec<IpAddr>, ResolveError> {
    match result {
        Ok(lookup) => Ok(lookup
            .record_iter()
            .filter_map(|r| match r.data() {
                RData::A(a) => Some(IpAddr::V4(a.0)),
                RData::AAAA(a) => Some(IpAddr::V6(a.0)),
                _ => None,
            })
            .collect()),
        Err(e) if no_records(&e) => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

/// Whether `e` is the server saying the name has no such records. hickory reports SERVFAIL,
/// REFUSED and the like as `NoRecordsFound` too (untrusted), so the response code decides.
fn no_records(e: &ResolveError) -> bool {
    matches!(
        e.proto().map(|p| p.kind()),
        Some(ProtoErrorKind::NoRecordsFound {
            response_code: ResponseCode::NXDomain | ResponseCode::NoError,
            ..
        })
    )
}

/// What went wrong, for the log: hickory words a SERVFAIL as "no records found for Query {..}",
/// which reads like an empty answer, so an error response is named by its code.
fn why(e: &ResolveError) -> String {
    match e.proto().map(|p| p.kind()) {
        Some(ProtoErrorKind::NoRecordsFound { response_code, .. }) => {
            format!(
                "the server answered {response_code} ({})",
                u16::from(*response_code)
            )
        }
        _ => e.to_string(),
    }
}

/// The engines at `ips`, sorted by url (and deduplicated) so two rounds' sets compare equal
/// whatever order the server listed the records in.
fn engines(
    d: &Discovery,
    port: Option<u16>,
    grpc_port: Option<u16>,
    ips: impl IntoIterator<Item = IpAddr>,
) -> Vec<Engine> {
    let mut set: Vec<Engine> = ips
        .into_iter()
        .filter_map(|ip| {
            let at = format!("{} {}", d.at, ip);
            match d
                .template
                .engine(&at, ip, port, grpc_port, Default::default())
            {
                Ok(e) => Some(e),
                Err(e) => {
                    // Config validation tried the template on a stand-in address; an address
                    // that still fails is skipped, not the whole set.
                    tracing::error!(error = %e, "discovered address skipped");
                    None
                }
            }
        })
        .collect();
    set.sort_by(|a, b| a.url.cmp(&b.url));
    set.dedup_by(|a, b| a.url == b.url);
    set
}

/// Whether resolution is failing, so an outage logs once when it starts and once when it ends
/// rather than once per interval.
#[derive(Debug, Default)]
struct Outage {
    failing: bool,
}

impl Outage {
    /// Records a failed round; true when it starts an outage.
    fn fail(&mut self) -> bool {
        !std::mem::replace(&mut self.failing, true)
    }

    /// Records a successful round; true when it ends an outage.
    fn recover(&mut self) -> bool {
        std::mem::replace(&mut self.failing, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use hickory_resolver::proto::op::Query;
    use hickory_resolver::proto::ProtoError;

    fn negative(code: ResponseCode) -> ResolveError {
        ProtoError::nx_error(Box::new(Query::new()), None, None, None, code, false, None).into()
    }

    #[test]
    fn nxdomain_and_nodata_are_empty_other_codes_are_failures() {
        for code in [ResponseCode::NXDomain, ResponseCode::NoError] {
            assert_eq!(answer(Err(negative(code))).unwrap(), Vec::<IpAddr>::new());
        }
        for code in [
            ResponseCode::ServFail,
            ResponseCode::Refused,
            ResponseCode::NotImp,
        ] {
            assert!(answer(Err(negative(code))).is_err(), "{code:?}");
        }
        let timeout: ResolveError = ProtoError::from(ProtoErrorKind::Timeout).into();
        assert!(answer(Err(timeout)).is_err());
        let servfail = RoundError::Lookup {
            family: RecordType::AAAA,
            source: negative(ResponseCode::ServFail),
        };
        assert_eq!(
            servfail.to_string(),
            "AAAA lookup failed: the server answered Server Failure (2)"
        );
    }

    #[test]
    fn outage_logs_at_its_edges_only() {
        let mut o = Outage::default();
        assert!(!o.recover(), "a first success is no recovery");
        assert!(o.fail());
        assert!(!o.fail());
        assert!(o.recover());
        assert!(!o.recover());
        assert!(o.fail());
    }

    #[test]
    fn query_timeout_follows_the_interval_within_bounds() {
        assert_eq!(query_timeout(Duration::from_millis(100)), MIN_QUERY_TIMEOUT);
        assert_eq!(
            query_timeout(Duration::from_secs(3)),
            Duration::from_secs(3)
        );
        assert_eq!(query_timeout(Duration::from_secs(60)), MAX_QUERY_TIMEOUT);
    }

    #[test]
    fn engines_are_sorted_and_deduplicated() {
        let c = Config::from_str(
            "[[discovery]]\nkind = \"dns\"\nname = \"vllm.svc\"\nport = 8000\nflavor = \"vllm\"\ndp_size = 2",
        )
        .unwrap();
        let d = &c.discovery[0];
        let ips: Vec<IpAddr> = ["10.0.0.9", "fd00::1", "10.0.0.10", "10.0.0.9"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let set = engines(d, Some(8000), None, ips);
        let urls: Vec<&str> = set.iter().map(|e| &*e.url).collect();
        assert_eq!(
            urls,
            [
                "http://10.0.0.10:8000",
                "http://10.0.0.9:8000",
                "http://[fd00::1]:8000"
            ]
        );
        assert!(set.iter().all(|e| e.dp_size == 2));
    }
}
