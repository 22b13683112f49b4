//! What a test or tool may read from a running simulated engine (requests served and seen,
//! KV, prefix cache, event subscribers) and the fault knobs it may turn while it runs.

use super::*;

/// What the engine saw of one proxied request, for tests to inspect. Recorded once the pin is
/// resolved (a pin the engine refuses leaves no record), before the model is checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    pub method: http::Method,
    pub path: String,
    /// The `X-data-parallel-rank` header as received.
    pub rank_header: Option<String>,
    /// The body's `data_parallel_rank` (else `routed_dp_rank`) as received.
    pub body_rank: Option<Value>,
    /// The global rank that served it.
    pub rank: u32,
    /// The body's (or form's) `model` as received; `None` when the request named none.
    pub model: Option<String>,
    /// The `Authorization` header as received.
    pub authorization: Option<String>,
    /// The `x-request-id` header as received.
    pub request_id: Option<String>,
    /// The `x-forwarded-for` header as received.
    pub forwarded_for: Option<String>,
    /// The `traceparent` header as received.
    pub traceparent: Option<String>,
    /// The names of every header received (lowercase).
    pub header_names: Vec<String>,
    /// The address of the connection it came on (the proxy's side of it).
    pub peer: Option<std::net::SocketAddr>,
}

impl SimEngine {
    /// Requests admitted per local rank.
    pub fn served(&self) -> Vec<u64> {
        self.sim
            .ranks
            .iter()
            .map(|r| r.served.load(Relaxed))
            .collect()
    }

    /// Current KV usage per local rank (real occupancy, ignoring pinned values).
    pub fn kv_usage(&self) -> Vec<f64> {
        self.sim.ranks.iter().map(|r| r.kv_usage()).collect()
    }

    /// Per local rank: (prompt tokens that looked up the prefix cache, tokens found there), the
    /// figures behind `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total`.
    pub fn prefix_cache(&self) -> Vec<(u64, u64)> {
        self.sim
            .ranks
            .iter()
            .map(|r| {
                let c = r.counts();
                (c.prefix_queries, c.prefix_hits)
            })
            .collect()
    }

    /// Requests decoding right now, per local rank.
    pub fn running(&self) -> Vec<u32> {
        self.sim.ranks.iter().map(|r| r.counts().running).collect()
    }

    /// What the engine saw of recent requests, oldest first.
    pub fn seen(&self) -> Vec<Seen> {
        lock(&self.sim.seen).iter().cloned().collect()
    }

    /// What the engine saw of recent gRPC inference calls (`Generate`, `Embed`, `Abort`), oldest
    /// first.
    pub fn grpc_seen(&self) -> Vec<GrpcSeen> {
        lock(&self.sim.grpc_seen).iter().cloned().collect()
    }

    /// The request ids gRPC `Abort` named, running or not, oldest first.
    pub fn aborted(&self) -> Vec<String> {
        lock(&self.sim.aborted).iter().cloned().collect()
    }

    /// How many telemetry requests (`/metrics`, `/v1/loads`, `GetLoads`) the engine answered.
    pub fn telemetry_requests(&self) -> u64 {
        self.sim.telemetry_requests.load(Relaxed)
    }

    /// Pins the reported KV usage per local rank (empty: report real occupancy).
    pub fn set_kv_usage(&self, kv: Vec<f64>) {
        write(&self.sim.knobs).kv_usage = kv;
    }

    /// Leaves these GLOBAL ranks' series out of `/metrics`.
    pub fn set_dark_ranks(&self, ranks: Vec<u32>) {
        write(&self.sim.knobs).dark_ranks = ranks;
    }

    /// Makes every `/metrics` answer wait this long first, like a saturated engine.
    pub fn set_metrics_delay(&self, d: Duration) {
        write(&self.sim.knobs).metrics_delay = d;
    }

    /// Breaks (or mends) the native load endpoints; `/metrics` keeps working.
    pub fn set_native_failing(&self, failing: bool) {
        write(&self.sim.knobs).native_failing = failing;
    }

    /// Answers that share (percent, 0..=100; 0 is off) of proxied requests at once with
    /// `status` and an OpenAI error body, admitting nothing. The share restarts counting here:
    /// 100% fails every request, 50% every second one.
    pub fn set_fail(&self, status: u16, percent: f64) -> Result<(), FaultError> {
        self.sim.faults.set_fail(status, percent)
    }

    /// Accepts proxied requests and never answers them (no headers) until the client leaves.
    pub fn set_hang_requests(&self, hang: bool) {
        self.sim.faults.hang_requests.store(hang, Relaxed);
    }

    /// Makes `/metrics`, `/v1/loads` and gRPC `GetLoads` never answer.
    pub fn set_hang_metrics(&self, hang: bool) {
        self.sim.faults.hang_metrics.store(hang, Relaxed);
    }

    /// Makes `/v1/models` never answer.
    pub fn set_hang_models(&self, hang: bool) {
        self.sim.faults.hang_models.store(hang, Relaxed);
    }

    /// The next `n` proxied requests fail at once with the failing status (`fail_first`).
    pub fn set_fail_first(&self, n: u64) {
        self.sim.faults.set_fail_first(n);
    }

    /// What `/health` answers from now on (200 is healthy).
    pub fn set_health_status(&self, status: u16) -> Result<(), FaultError> {
        self.sim.faults.set_health(status)
    }

    /// Dies by itself once `n` more requests have been admitted into ranks (`Some(0)`: now);
    /// `None` cancels.
    pub fn die_after(&self, n: Option<u64>) {
        self.sim.faults.set_die_after(n);
        if n == Some(0) {
            self.sim.kill();
        }
    }

    /// Generation stops after `k` tokens, streaming or not, and the response never ends (the
    /// request keeps its KV) until the client leaves; `None` resumes normal decoding.
    pub fn set_stall_after_tokens(&self, k: Option<u64>) {
        self.sim.faults.set_stall_after(k);
    }

    /// Proxied requests that reached the engine, including failed, hung and rejected ones (not
    /// those refused for a missing API key).
    pub fn requests_received(&self) -> u64 {
        self.sim.faults.received.load(Relaxed)
    }

    /// Proxied requests the engine still holds (reading, queued, decoding, hung or stalled).
    pub fn open_requests(&self) -> u64 {
        self.sim.faults.open.load(Relaxed)
    }

    /// Dies like a process under `kill -9` and returns once it is dead: the listeners are closed
    /// (connecting is refused) and every connection, HTTP and gRPC, was dropped mid-whatever.
    pub async fn kill(&self) {
        self.sim.kill();
        self.dead().await;
    }

    /// Whether the engine was killed (it may still be closing its connections).
    pub fn is_dead(&self) -> bool {
        self.sim.is_dead()
    }

    /// Resolves once the engine has been killed (by [`SimEngine::kill`] or `die_after`) and
    /// every server has closed its listener and connections.
    pub async fn dead(&self) {
        let mut kill = self.sim.kill.subscribe();
        net::killed(&mut kill).await;
        let mut servers = self.sim.servers.subscribe();
        // The sender lives in `self.sim`, so this cannot fail while `self` is borrowed.
        let _ = servers.wait_for(|n| *n == 0).await;
    }

    /// Per local rank, the endpoint its KV events are published on, as `/kv_event_sources`
    /// reports it (`tcp://*:PORT` when bound, `tcp://HOST:PORT` when dialling); empty with
    /// events off.
    pub fn kv_event_endpoints(&self) -> Vec<String> {
        self.sim
            .kv_publishers
            .iter()
            .map(|p| p.endpoint.clone())
            .collect()
    }

    /// Per local rank, the address its KV-event PUB socket is bound to (`None` when it dials);
    /// empty with events off.
    pub fn kv_event_addrs(&self) -> Vec<Option<SocketAddr>> {
        self.sim.kv_publishers.iter().map(|p| p.bound).collect()
    }

    /// Per local rank, the address its replay socket is bound to (`None` without one).
    pub fn kv_replay_addrs(&self) -> Vec<Option<SocketAddr>> {
        self.sim.kv_publishers.iter().map(|p| p.replay).collect()
    }

    /// Per local rank, KV-event subscribers connected and subscribed right now.
    pub fn kv_event_subscribers(&self) -> Vec<usize> {
        self.sim
            .kv_publishers
            .iter()
            .map(|p| p.subscribers())
            .collect()
    }

    /// Per local rank, KV-event messages dropped because a subscriber's queue was full.
    pub fn kv_events_dropped(&self) -> Vec<u64> {
        self.sim.kv_publishers.iter().map(|p| p.dropped()).collect()
    }

    /// Per local rank, the ids of the blocks its prefix cache holds (running requests' and
    /// idle ones), sorted: what a subscriber's index should hold.
    pub fn cached_blocks(&self) -> Vec<Vec<u64>> {
        self.sim.ranks.iter().map(|r| r.cached_ids()).collect()
    }
}
