//! The `[server]` table: the front door's listeners, limits, timeouts and access keys. Every
//! duration has bounds, every limit a floor; an error names the key.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use super::duration::{duration, ms, secs, HumanDuration};
use super::edge::{trusted_proxies, Cidr, ExposeWorker, DEFAULT_EXPOSE_WORKER};
use super::error::{invalid, ConfigError};
use super::tls::ListenerTls;
use super::token::admin_token;
pub use super::token::AdminToken;

/// The stream limit most gRPC servers advertise or are deployed with; an engine that allows more
/// only gets a second connection it did not need.
pub const DEFAULT_GRPC_STREAMS_PER_CONNECTION: usize = 100;
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9090";
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 * 1024 * 1024;
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// A non-streamed vLLM answer sends its headers only when the whole completion is done, so the
/// wait for response headers must allow for the longest generation.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(30 * 60);
pub const DEFAULT_STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(5 * 60);
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// A whole body of `DEFAULT_MAX_BODY_BYTES` at a slow client's 1 MB/s takes about half of it.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(60);
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// A client that takes nothing of its answer for this long is cut (nginx's `send_timeout`).
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(60);
/// Unless `server.max_streams_per_client` says otherwise, one client address may have this many
/// requests in flight at once: a quarter of an engine's default connection cap, well below what
/// one engine takes.
pub const DEFAULT_MAX_STREAMS_PER_CLIENT: usize = DEFAULT_MAX_ENGINE_CONNECTIONS / 4;
/// One client address may hold at most 1/this of any one engine's connection slots, so the
/// others still find slots on it.
pub const ENGINE_SHARE_PER_CLIENT: usize = 2;
pub const DEFAULT_H2_KEEPALIVE: Duration = Duration::from_secs(20);
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;
/// hyper cannot read HTTP/1 headers into a smaller buffer than this.
pub const MIN_MAX_HEADER_BYTES: usize = 8 * 1024;
/// Request heads beyond this are an attack, not a client.
pub const MAX_MAX_HEADER_BYTES: usize = 16 * 1024 * 1024;
pub const DEFAULT_MAX_ENGINE_CONNECTIONS: usize = 1024;
pub const DEFAULT_DRAIN_GRACE: Duration = Duration::from_secs(30);
/// Unless `server.max_connections_per_client` says otherwise, one client address may hold this
/// share of `max_connections` (1/8): enough for a NAT or a gateway in front carrying many
/// users, while it takes at least 8 addresses to fill the table.
pub const DEFAULT_CLIENT_SHARE: usize = 8;
/// IPv6 clients count against `max_connections_per_client` by this prefix unless
/// `server.client_ipv6_prefix` says otherwise: one host is commonly given a whole /64, so
/// counting each address apart let one host hold the table alone.
pub const DEFAULT_CLIENT_IPV6_PREFIX: u8 = 64;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    listen: Option<String>,
    admin_listen: Option<String>,
    grpc_listen: Option<String>,
    max_body_bytes: Option<usize>,
    connect_timeout: Option<HumanDuration>,
    response_timeout: Option<HumanDuration>,
    stream_idle_timeout: Option<HumanDuration>,
    header_read_timeout: Option<HumanDuration>,
    body_read_timeout: Option<HumanDuration>,
    body_timeout: Option<HumanDuration>,
    idle_timeout: Option<HumanDuration>,
    send_timeout: Option<HumanDuration>,
    h2_keepalive_interval: Option<HumanDuration>,
    max_header_bytes: Option<usize>,
    max_connections: Option<usize>,
    max_connections_per_client: Option<usize>,
    client_ipv6_prefix: Option<i64>,
    max_engine_connections: Option<usize>,
    grpc_streams_per_connection: Option<usize>,
    max_in_flight: Option<usize>,
    max_streams_per_client: Option<usize>,
    shutdown_delay: Option<HumanDuration>,
    drain_grace: Option<HumanDuration>,
    extra_routes: Option<Vec<String>>,
    api_keys_env: Option<String>,
    api_keys_file: Option<std::path::PathBuf>,
    cors_allow_origins: Option<Vec<String>>,
    admin_token_env: Option<String>,
    ready_requires_routable: Option<bool>,
    access_log: Option<bool>,
    thread_per_core: Option<bool>,
    tls: Option<ListenerTls>,
    admin_tls: Option<ListenerTls>,
    expose_worker: Option<ExposeWorker>,
    trusted_proxies: Option<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    /// The gRPC (h2c) front door, for engines' own gRPC APIs; off when unset.
    pub grpc_listen: Option<SocketAddr>,
    pub max_body_bytes: usize,
    /// A new engine connection established (TCP, TLS, an h2 engine's first frame), one
    /// deadline for all of it.
    pub connect_timeout: Duration,
    /// Longest wait for an engine's response headers.
    pub response_timeout: Duration,
    /// Longest gap between two body chunks of an engine's response.
    pub stream_idle_timeout: Duration,
    /// Longest a new client connection may take to deliver its first request's headers
    /// (HTTP version sniff and h2 preface included).
    pub header_read_timeout: Duration,
    /// Longest gap between two chunks of a client's request body.
    pub body_read_timeout: Duration,
    /// Longest a client's whole request body may take, however steadily it drips.
    pub body_timeout: Duration,
    /// A client connection with no request in progress for this long is closed.
    pub idle_timeout: Duration,
    /// A client connection whose answer could not be written for this long (the client takes
    /// nothing of it) is cut, and its engine requests with it.
    pub send_timeout: Duration,
    /// HTTP/2 keep-alive ping interval (and how long a ping may go unanswered).
    pub h2_keepalive_interval: Duration,
    pub max_header_bytes: usize,
    /// Client connections open at once; `None`: derived from the file descriptor limit.
    pub max_connections: Option<usize>,
    /// Client connections one client address may hold at once; `None`: a share of
    /// `max_connections` ([`DEFAULT_CLIENT_SHARE`]).
    pub max_connections_per_client: Option<usize>,
    /// The prefix length an IPv6 client address is counted by (1 to 128; 128: each address
    /// apart). IPv4 addresses, IPv4-mapped ones included, count one by one.
    pub client_ipv6_prefix: u8,
    /// Connections rankgate opens to one engine at once (HTTP/1: requests in flight on it).
    pub max_engine_connections: usize,
    /// gRPC calls one h2 connection to an engine carries before the next call opens another
    /// (up to `max_engine_connections`): the engine's SETTINGS_MAX_CONCURRENT_STREAMS, or below.
    pub grpc_streams_per_connection: usize,
    /// Requests in flight through the front door at once; `None`: unlimited.
    pub max_in_flight: Option<usize>,
    /// Requests one client address may have in flight at once (429 beyond; peers in
    /// `trusted_proxies` are not held to it); `None`: [`DEFAULT_MAX_STREAMS_PER_CLIENT`].
    pub max_streams_per_client: Option<usize>,
    /// After a shutdown signal, how long to keep accepting (while `/ready` says 503).
    pub shutdown_delay: Duration,
    /// How long requests and streams in flight may take to finish once accepting stops.
    pub drain_grace: Duration,
    /// Paths proxied besides the flavors' own route tables (POST, rank pinned by header).
    pub extra_routes: Vec<String>,
    /// The environment variable holding the accepted client keys (comma-separated).
    pub api_keys_env: Option<String>,
    /// A file with one accepted client key per line.
    pub api_keys_file: Option<std::path::PathBuf>,
    /// Origins browsers may call from (`*` for any); empty: no CORS.
    pub cors_allow_origins: Vec<String>,
    /// The environment variable holding the bearer token the admin API's mutations need;
    /// `None`: mutations are refused.
    pub admin_token_env: Option<String>,
    /// Its value, read at load so that `check` catches an unset variable too.
    pub admin_token: Option<AdminToken>,
    /// `/ready` answers 503 while no rank is routable (the default). A Service then drops every
    /// replica during a fleet-wide engine outage and clients get connection refused; `false`
    /// keeps the pods in, so clients get rankgate's own 503 with `Retry-After`.
    pub ready_requires_routable: bool,
    /// One log line per request (target `rankgate::access`, at info).
    pub access_log: bool,
    /// The HTTP front door on one single-threaded runtime per core, each with its own
    /// `SO_REUSEPORT` listener and engine connection pool (see [`crate::app`]); the default.
    pub thread_per_core: bool,
    /// TLS on the OpenAI front door and the gRPC front door (HTTP/1.1 and h2 by ALPN).
    pub tls: Option<ListenerTls>,
    /// TLS on the admin listener.
    pub admin_tls: Option<ListenerTls>,
    /// What clients are told of the engine that served them (see [`ExposeWorker`]).
    pub expose_worker: ExposeWorker,
    /// Peers whose `X-Forwarded-*` headers are kept (appended to); everyone else's are
    /// replaced by what rankgate saw itself. Empty: nobody's.
    pub trusted_proxies: Vec<Cidr>,
}

impl ServerConfig {
    /// Requests one client address may have in flight at once (`max_streams_per_client`, or
    /// its default).
    pub fn streams_per_client(&self) -> usize {
        (self.max_streams_per_client).unwrap_or(DEFAULT_MAX_STREAMS_PER_CLIENT)
    }
}

fn parse_addr(key: &str, v: Option<String>, default: &str) -> Result<SocketAddr, ConfigError> {
    let s = v.as_deref().unwrap_or(default);
    s.parse()
        .map_err(|_| invalid(key, format!("{s:?} is not an IP:port socket address")))
}

/// A `[server]` duration's default and the range it must fall in.
struct Bounds {
    default: Duration,
    min: Duration,
    max: Duration,
}

impl Bounds {
    const fn new(default: Duration, min: Duration, max: Duration) -> Bounds {
        Bounds { default, min, max }
    }

    fn read(&self, key: &str, v: Option<HumanDuration>) -> Result<Duration, ConfigError> {
        duration(key, v, self.default, self.min, self.max)
    }
}

const CONNECT_TIMEOUT: Bounds = Bounds::new(DEFAULT_CONNECT_TIMEOUT, ms(10), secs(300));
const RESPONSE_TIMEOUT: Bounds = Bounds::new(DEFAULT_RESPONSE_TIMEOUT, ms(100), secs(24 * 3600));
const STREAM_IDLE_TIMEOUT: Bounds =
    Bounds::new(DEFAULT_STREAM_IDLE_TIMEOUT, ms(100), secs(24 * 3600));
const HEADER_READ_TIMEOUT: Bounds = Bounds::new(DEFAULT_HEADER_READ_TIMEOUT, ms(100), secs(600));
const BODY_READ_TIMEOUT: Bounds = Bounds::new(DEFAULT_BODY_READ_TIMEOUT, ms(100), secs(3600));
const BODY_TIMEOUT: Bounds = Bounds::new(DEFAULT_BODY_TIMEOUT, ms(100), secs(24 * 3600));
const IDLE_TIMEOUT: Bounds = Bounds::new(DEFAULT_IDLE_TIMEOUT, ms(100), secs(3600));
const SEND_TIMEOUT: Bounds = Bounds::new(DEFAULT_SEND_TIMEOUT, ms(100), secs(3600));
const H2_KEEPALIVE: Bounds = Bounds::new(DEFAULT_H2_KEEPALIVE, ms(100), secs(3600));
const SHUTDOWN_DELAY: Bounds = Bounds::new(Duration::ZERO, Duration::ZERO, secs(600));
const DRAIN_GRACE: Bounds = Bounds::new(DEFAULT_DRAIN_GRACE, Duration::ZERO, secs(3600));

/// Validates `[server]`: each value read (or defaulted), then the rules on them, in the order
/// their errors are reported.
pub(super) fn server(raw: RawServer) -> Result<ServerConfig, ConfigError> {
    let mut server = read(raw)?;
    check_limits(&server)?;
    check_env_names(&server)?;
    server.admin_token = (server.admin_token_env.as_deref())
        .map(admin_token)
        .transpose()?;
    check_access(&server)?;
    check_listeners(&server)?;
    Ok(server)
}

/// Every `[server]` value, its default where it is left out; addresses parse and durations
/// fall in their ranges (in the order of the fields, which is the order of their errors).
fn read(raw: RawServer) -> Result<ServerConfig, ConfigError> {
    Ok(ServerConfig {
        listen: parse_addr("server.listen", raw.listen, DEFAULT_LISTEN)?,
        admin_listen: parse_addr(
            "server.admin_listen",
            raw.admin_listen,
            DEFAULT_ADMIN_LISTEN,
        )?,
        grpc_listen: (raw.grpc_listen)
            .map(|a| parse_addr("server.grpc_listen", Some(a), ""))
            .transpose()?,
        max_body_bytes: raw.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES),
        connect_timeout: CONNECT_TIMEOUT.read("server.connect_timeout", raw.connect_timeout)?,
        response_timeout: RESPONSE_TIMEOUT.read("server.response_timeout", raw.response_timeout)?,
        stream_idle_timeout: STREAM_IDLE_TIMEOUT
            .read("server.stream_idle_timeout", raw.stream_idle_timeout)?,
        header_read_timeout: HEADER_READ_TIMEOUT
            .read("server.header_read_timeout", raw.header_read_timeout)?,
        body_read_timeout: BODY_READ_TIMEOUT
            .read("server.body_read_timeout", raw.body_read_timeout)?,
        body_timeout: BODY_TIMEOUT.read("server.body_timeout", raw.body_timeout)?,
        idle_timeout: IDLE_TIMEOUT.read("server.idle_timeout", raw.idle_timeout)?,
        send_timeout: SEND_TIMEOUT.read("server.send_timeout", raw.send_timeout)?,
        h2_keepalive_interval: H2_KEEPALIVE
            .read("server.h2_keepalive_interval", raw.h2_keepalive_interval)?,
        max_header_bytes: raw.max_header_bytes.unwrap_or(DEFAULT_MAX_HEADER_BYTES),
        max_connections: raw.max_connections,
        max_connections_per_client: raw.max_connections_per_client,
        client_ipv6_prefix: client_ipv6_prefix(raw.client_ipv6_prefix)?,
        max_engine_connections: (raw.max_engine_connections)
            .unwrap_or(DEFAULT_MAX_ENGINE_CONNECTIONS),
        grpc_streams_per_connection: (raw.grpc_streams_per_connection)
            .unwrap_or(DEFAULT_GRPC_STREAMS_PER_CONNECTION),
        max_in_flight: raw.max_in_flight,
        max_streams_per_client: raw.max_streams_per_client,
        shutdown_delay: SHUTDOWN_DELAY.read("server.shutdown_delay", raw.shutdown_delay)?,
        drain_grace: DRAIN_GRACE.read("server.drain_grace", raw.drain_grace)?,
        extra_routes: raw.extra_routes.unwrap_or_default(),
        api_keys_env: raw.api_keys_env,
        api_keys_file: raw.api_keys_file,
        cors_allow_origins: raw.cors_allow_origins.unwrap_or_default(),
        admin_token: None,
        ready_requires_routable: raw.ready_requires_routable.unwrap_or(true),
        access_log: raw.access_log.unwrap_or(false),
        thread_per_core: raw.thread_per_core.unwrap_or(true),
        admin_token_env: raw.admin_token_env,
        tls: raw.tls,
        admin_tls: raw.admin_tls,
        expose_worker: raw.expose_worker.unwrap_or(DEFAULT_EXPOSE_WORKER),
        trusted_proxies: trusted_proxies(raw.trusted_proxies)?,
    })
}

/// `server.client_ipv6_prefix`: a prefix length, 1 to 128.
fn client_ipv6_prefix(v: Option<i64>) -> Result<u8, ConfigError> {
    let Some(v) = v else {
        return Ok(DEFAULT_CLIENT_IPV6_PREFIX);
    };
    u8::try_from(v).ok().filter(|p| (1..=128).contains(p)).ok_or_else(|| {
        invalid(
            "server.client_ipv6_prefix",
            format!("{v} is not a prefix length from 1 to 128 (64: a host's /64, the default; 128: each address apart)"),
        )
    })
}

/// Sizes and counts: a body must be allowed, headers fit hyper's floor and an attack's cap,
/// and a count set to 0 would refuse everything.
fn check_limits(server: &ServerConfig) -> Result<(), ConfigError> {
    if server.max_body_bytes == 0 {
        return Err(invalid("server.max_body_bytes", "must be greater than 0"));
    }
    if !(MIN_MAX_HEADER_BYTES..=MAX_MAX_HEADER_BYTES).contains(&server.max_header_bytes) {
        return Err(invalid(
            "server.max_header_bytes",
            format!(
                "{} is outside [{MIN_MAX_HEADER_BYTES}, {MAX_MAX_HEADER_BYTES}] (hyper needs the floor; beyond the cap it is an attack)",
                server.max_header_bytes
            ),
        ));
    }
    for (key, v) in [
        ("server.max_connections", server.max_connections),
        (
            "server.max_connections_per_client",
            server.max_connections_per_client,
        ),
        (
            "server.max_engine_connections",
            Some(server.max_engine_connections),
        ),
        ("server.max_in_flight", server.max_in_flight),
        (
            "server.max_streams_per_client",
            server.max_streams_per_client,
        ),
        (
            "server.grpc_streams_per_connection",
            Some(server.grpc_streams_per_connection),
        ),
    ] {
        if v == Some(0) {
            return Err(invalid(
                key,
                "must be greater than 0 (leave it out for the default)",
            ));
        }
    }
    Ok(())
}

/// The keys naming environment variables name ones that can exist.
fn check_env_names(server: &ServerConfig) -> Result<(), ConfigError> {
    for (key, var) in [
        ("server.api_keys_env", &server.api_keys_env),
        ("server.admin_token_env", &server.admin_token_env),
    ] {
        if let Some(var) = var {
            if var.is_empty() || var.contains(['=', '\0']) {
                return Err(invalid(
                    key,
                    format!("{var:?} is not an environment variable name"),
                ));
            }
        }
    }
    Ok(())
}

/// Who may call: the client key file is named if set, each CORS origin is one a browser sends.
fn check_access(server: &ServerConfig) -> Result<(), ConfigError> {
    if server
        .api_keys_file
        .as_ref()
        .is_some_and(|p| p.as_os_str().is_empty())
    {
        return Err(invalid(
            "server.api_keys_file",
            "is empty: name the file, or leave the key out",
        ));
    }
    for (i, o) in server.cors_allow_origins.iter().enumerate() {
        check_origin(o).map_err(|p| invalid(format!("server.cors_allow_origins[{i}]"), p))?;
    }
    Ok(())
}

/// The listeners are distinct (port 0, "any free port", never collides).
fn check_listeners(server: &ServerConfig) -> Result<(), ConfigError> {
    if server.listen == server.admin_listen && server.listen.port() != 0 {
        return Err(invalid(
            "server.admin_listen",
            "must differ from server.listen",
        ));
    }
    if let Some(g) = server.grpc_listen {
        if g.port() != 0 && (g == server.listen || g == server.admin_listen) {
            return Err(invalid(
                "server.grpc_listen",
                "must differ from server.listen and server.admin_listen",
            ));
        }
    }
    Ok(())
}

/// An allowed CORS origin is `*` or what a browser sends in `Origin`: `scheme://host[:port]`,
/// nothing after. Anything else could never match, so it is refused here rather than silently
/// ignored per request.
fn check_origin(o: &str) -> Result<(), String> {
    if o == "*" {
        return Ok(());
    }
    let Some((scheme, host)) = o.split_once("://") else {
        return Err(format!(
            "{o:?} is not an origin: write \"scheme://host[:port]\" or \"*\""
        ));
    };
    if scheme.is_empty() || host.is_empty() {
        return Err(format!("{o:?} lacks a scheme or a host"));
    }
    if host.contains('/') {
        return Err(format!(
            "{o:?} has a path (or a trailing /): browsers send the origin without one"
        ));
    }
    if !o.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "{o:?} must be ASCII without spaces (browsers send hosts in punycode)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::Config;

    const ENGINE: &str = "[[engines]]\nurl = \"http://a:1\"\n";

    #[test]
    fn ready_requires_routable_defaults_on_and_reads_a_bool() {
        let on = Config::from_str(ENGINE).unwrap();
        assert!(on.server.ready_requires_routable);
        let off = Config::from_str(&format!(
            "[server]\nready_requires_routable = false\n{ENGINE}"
        ))
        .unwrap();
        assert!(!off.server.ready_requires_routable);
        // Changing it waits for a restart, and a reload says so.
        assert_eq!(on.restart_needed(&off), ["server.ready_requires_routable"]);
        let e = Config::from_str(&format!(
            "[server]\nready_requires_routable = \"no\"\n{ENGINE}"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("ready_requires_routable"), "{e}");
    }

    #[test]
    fn client_ipv6_prefix_defaults_to_64_and_must_be_1_to_128() {
        let d = Config::from_str(ENGINE).unwrap();
        assert_eq!(d.server.client_ipv6_prefix, 64);
        let all =
            Config::from_str(&format!("[server]\nclient_ipv6_prefix = 128\n{ENGINE}")).unwrap();
        assert_eq!(all.server.client_ipv6_prefix, 128);
        assert_eq!(d.restart_needed(&all), ["server.client_ipv6_prefix"]);
        for bad in ["0", "129", "-1", "100000"] {
            let e = Config::from_str(&format!("[server]\nclient_ipv6_prefix = {bad}\n{ENGINE}"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("server.client_ipv6_prefix") && e.contains("1 to 128"),
                "{bad}: {e}"
            );
        }
    }
}
