//! Which settings a reload cannot apply. Only `[[engines]]` and `[[routes]]` take effect on
//! reload; every other setting is fixed for the life of the process (listeners are bound, pools sized, discovery
//! tasks running), so a reload names the ones that differ.
//!
//! The settings are listed once, in [`restart_keys!`]: a new `[server]` key that needs a
//! restart is one more name there, and its message follows from the name.

use super::whole::Config;

/// A setting that waits for a restart: its name in the file, and whether two configs differ in
/// it.
type Key = (&'static str, fn(&Config, &Config) -> bool);

/// Builds [`RESTART_KEYS`] from field names: `server: a, b;` lists `[server]` fields, named
/// `server.a`; `whole: c;` lists whole tables, named `c`. Each comparison is the field's `!=`.
macro_rules! restart_keys {
    (server: $($s:ident),* ; whole: $($w:ident),* ;) => {
        const RESTART_KEYS: &[Key] = &[
            $((concat!("server.", stringify!($s)), |a, b| a.server.$s != b.server.$s),)*
            $((stringify!($w), |a, b| a.$w != b.$w),)*
        ];
    };
}

// In the order a reload reports them. `tls` and `admin_tls` are their paths: the files'
// contents reload on their own (SIGHUP, a change on disk).
restart_keys! {
    server: listen, admin_listen, grpc_listen, max_body_bytes, connect_timeout, response_timeout,
        stream_idle_timeout, header_read_timeout, body_read_timeout, body_timeout,
        idle_timeout, send_timeout,
        h2_keepalive_interval, max_header_bytes, max_connections,
        max_connections_per_client, client_ipv6_prefix, max_engine_connections,
        grpc_streams_per_connection, max_in_flight, max_streams_per_client, shutdown_delay,
        drain_grace, extra_routes,
        api_keys_env, api_keys_file, cors_allow_origins, admin_token_env, ready_requires_routable,
        access_log,
        thread_per_core, tls, admin_tls;
    whole: engine_tls, routing, telemetry, discovery, tracing, models, flow;
}

impl Config {
    /// The settings other than `[[engines]]` and `[[routes]]` that differ between `self` (as started) and `new`.
    pub fn restart_needed(&self, new: &Config) -> Vec<&'static str> {
        let mut out: Vec<&'static str> = (RESTART_KEYS.iter())
            .filter(|(_, differs)| differs(self, new))
            .map(|(key, _)| *key)
            .collect();
        // A server key the list does not name (the admin token's value, read from its
        // variable) still says so.
        if self.server != new.server && !out.iter().any(|k| k.starts_with("server.")) {
            out.push("server");
        }
        out
    }
}
