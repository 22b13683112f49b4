//! Prefill/decode disaggregation: the simulated engine as a prefill (P) or a decode (D) server,
//! with the fields and semantics of the real engines, so a router's two-leg path can be tested
//! without GPUs.
//!
//! Two flavors, two protocols, as the engines have them:
//! - vLLM (`vllm`), NixlConnector in "pull" mode: P answers a request carrying
//!   `kv_transfer_params.do_remote_decode` with `kv_transfer_params` naming the blocks it keeps,
//!   its engine id and the side channel of the rank; D, given those params, pulls the blocks
//!   from that side channel and skips the prefill of what it got. P holds the blocks until D
//!   pulls them or the lease (`kv_lease`) runs out. The side channel is a tiny HTTP protocol of
//!   the sim's own (the real one is NIXL over UCX with a ZMQ handshake): one listener per P rank
//!   on `side_port + local rank`.
//! - SGLang (`sglang`): the same request goes to P and D at once with `bootstrap_host`,
//!   `bootstrap_port` and `bootstrap_room`; P prefills and hands the room's KV to the D that asks
//!   its bootstrap server (`bootstrap_port`) for it; D waits for it, bounded, then decodes.
//!
//! What a role server adds to an answer or to `/metrics` is here and in the flavor modules
//! (`metrics` renders the series); `generate` calls in at two points of a generation: before
//! the prefill ([`Sim::pd_before_prefill`]: D gets its KV) and after the last token
//! ([`Sim::pd_after_decode`]: P lends or hands over its KV).

mod metrics;
pub mod sglang;
pub mod vllm;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use super::prefix::BLOCK_TOKENS;
use super::rank::Admission;
use super::routes::Api;
use super::{net, Sim, SimConfig, SimEngine, SimFlavor};

/// Which side of a disaggregated pair the engine is. No role (`None` in
/// [`SimConfig::role`]) is the colocated engine that prefills and decodes its own requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PdRole {
    Prefill,
    Decode,
}

/// vLLM's default `kv_lease_duration` (seconds): how long P keeps blocks nobody pulled.
pub const DEFAULT_KV_LEASE: Duration = Duration::from_secs(30);
/// SGLang's `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` and `SGLANG_DISAGGREGATION_WAITING_TIMEOUT`
/// defaults (300 s): how long P waits for D to come for a room, and D for the room's KV.
pub const DEFAULT_SGLANG_TIMEOUT: Duration = Duration::from_secs(300);

/// KV bytes per token of the tiny model the fixtures were recorded with (2 layers x K and V x
/// 4 KV heads x 32 dims x 4 bytes, float32): 3 blocks of 128 tokens moved 786432 bytes.
pub const KV_BYTES_PER_TOKEN: u64 = 2048;
/// How fast the simulated KV moves between P and D (bytes a second): loopback-like, so the
/// transfer is small next to a prefill, as PD is meant to make it.
const TRANSFER_BYTES_PER_SEC: f64 = 10e9;

/// The disaggregation settings of a role server ([`SimConfig::pd`]); ignored without a role.
#[derive(Debug, Clone)]
pub struct PdConfig {
    /// vLLM `kv_transfer_config.engine_id`; `None`: `sim-<listen port>`.
    pub engine_id: Option<String>,
    /// vLLM P: how long blocks nobody pulled are held (`kv_lease_duration`).
    pub kv_lease: Duration,
    /// vLLM P: how long its answer's body comes after its head, the blocks lent already (as
    /// over a slow link to the router): a client that leaves meanwhile leaves them lent.
    pub answer_delay: Duration,
    /// vLLM P: the NIXL side channel's base port (`VLLM_NIXL_SIDE_CHANNEL_PORT`); local rank r
    /// listens on base + r. 0 picks a free port per rank.
    pub side_port: u16,
    /// vLLM P: the host its answers name as `remote_host` (`VLLM_NIXL_SIDE_CHANNEL_HOST`):
    /// where a decode pulls from. A prefill that names another host than its own is what a
    /// router must refuse (rankgate's `kv_params`).
    pub side_host: String,
    /// SGLang P: `--disaggregation-bootstrap-port`; 0 picks a free port.
    pub bootstrap_port: u16,
    /// SGLang P: how long a prefilled room waits for its D before the request fails.
    pub bootstrap_timeout: Duration,
    /// SGLang D: how long a request waits for its room's KV before it fails.
    pub waiting_timeout: Duration,
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            engine_id: None,
            kv_lease: DEFAULT_KV_LEASE,
            answer_delay: Duration::ZERO,
            side_port: 0,
            side_host: "127.0.0.1".into(),
            bootstrap_port: 0,
            bootstrap_timeout: DEFAULT_SGLANG_TIMEOUT,
            waiting_timeout: DEFAULT_SGLANG_TIMEOUT,
        }
    }
}

/// One rank's disaggregation counters: what `/metrics` reports and
/// [`SimEngine::pd_counts`] returns.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PdCounts {
    /// Prompt tokens this rank prefilled itself (`source="local_compute"`).
    pub local_compute: u64,
    /// Prompt tokens whose KV came from a P (`source="external_kv_transfer"`).
    pub external_kv_transfer: u64,
    /// KV bytes pulled, and the number of transfers (`vllm:nixl_bytes_transferred_{sum,count}`).
    pub bytes_transferred: u64,
    pub transfers: u64,
    /// Transfers that failed (`vllm:nixl_num_failed_transfers_total`).
    pub failed_transfers: u64,
    /// P: leases that ran out unpulled; D: pulls refused because the lease had run out
    /// (`vllm:nixl_num_kv_expired_reqs_total`).
    pub expired: u64,
    /// P: pulls that came after their lease ran out (`vllm:nixl_num_notifications_after_expiry_total`).
    pub notifications_after_expiry: u64,
    /// P: leases held right now, and their tokens (counted in the rank's KV usage).
    pub held_leases: u64,
    pub held_tokens: u64,
}

#[derive(Debug, Default)]
pub(crate) struct RankPd {
    local_compute: AtomicU64,
    external: AtomicU64,
    bytes: AtomicU64,
    transfers: AtomicU64,
    failed: AtomicU64,
    expired: AtomicU64,
    after_expiry: AtomicU64,
    held_leases: AtomicU64,
    held_tokens: AtomicU64,
}

impl RankPd {
    fn counts(&self) -> PdCounts {
        PdCounts {
            local_compute: self.local_compute.load(Relaxed),
            external_kv_transfer: self.external.load(Relaxed),
            bytes_transferred: self.bytes.load(Relaxed),
            transfers: self.transfers.load(Relaxed),
            failed_transfers: self.failed.load(Relaxed),
            expired: self.expired.load(Relaxed),
            notifications_after_expiry: self.after_expiry.load(Relaxed),
            held_leases: self.held_leases.load(Relaxed),
            held_tokens: self.held_tokens.load(Relaxed),
        }
    }
}

/// A role server's state: the listeners' ports, the counters, and each flavor's table (vLLM's
/// leases, SGLang's rooms).
#[derive(Default)]
pub(crate) struct PdState {
    pub(crate) engine_id: String,
    /// Per local rank, vLLM P's side-channel port.
    pub(crate) side_ports: Vec<u16>,
    /// SGLang P's bootstrap port.
    pub(crate) bootstrap_port: Option<u16>,
    pub(crate) ranks: Vec<RankPd>,
    pub(crate) leases: vllm::Leases,
    pub(crate) rooms: sglang::Rooms,
    client: std::sync::OnceLock<Client>,
}

/// The listeners a role server needs, bound before the engine starts so that their ports are
/// known to everything it answers.
pub(crate) struct Listeners {
    side: Vec<TcpListener>,
    bootstrap: Option<TcpListener>,
}

/// Binds what the role needs: vLLM P one side channel per rank, SGLang P its bootstrap server.
pub(crate) async fn bind(cfg: &SimConfig) -> std::io::Result<Listeners> {
    let mut l = Listeners {
        side: Vec::new(),
        bootstrap: None,
    };
    if cfg.role != Some(PdRole::Prefill) {
        return Ok(l);
    }
    let at = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    match cfg.flavor {
        SimFlavor::Vllm => {
            for r in 0..cfg.dp_size {
                let port = match cfg.pd.side_port {
                    0 => 0,
                    base => u16::try_from(u32::from(base) + r).map_err(|_| {
                        std::io::Error::new(
                            std::io::ErrorKind::InvalidInput,
                            format!("side port {base} + rank {r} is past 65535"),
                        )
                    })?,
                };
                l.side.push(TcpListener::bind(at(port)).await?);
            }
        }
        SimFlavor::Sglang => {
            l.bootstrap = Some(TcpListener::bind(at(cfg.pd.bootstrap_port)).await?);
        }
    }
    Ok(l)
}

impl PdState {
    pub(crate) fn new(cfg: &SimConfig, listen: SocketAddr, l: &Listeners) -> PdState {
        let port = |t: &TcpListener| t.local_addr().map(|a| a.port()).unwrap_or(0);
        PdState {
            engine_id: (cfg.pd.engine_id.clone())
                .unwrap_or_else(|| format!("sim-{}", listen.port())),
            side_ports: l.side.iter().map(port).collect(),
            bootstrap_port: l.bootstrap.as_ref().map(port),
            ranks: (0..cfg.dp_size).map(|_| RankPd::default()).collect(),
            leases: vllm::Leases::default(),
            rooms: sglang::Rooms::default(),
            client: std::sync::OnceLock::new(),
        }
    }
}

/// Serves the role's listeners until the engine shuts down or dies (they die with it, as the
/// real side channels die with a killed engine).
pub(crate) fn serve(sim: &Arc<Sim>, l: Listeners, shutdown: &watch::Receiver<bool>) {
    for (local, listener) in l.side.into_iter().enumerate() {
        let s = sim.clone();
        tokio::spawn(net::serve(
            listener,
            None,
            move |req| vllm::side_channel(s.clone(), local, req),
            shutdown.clone(),
            sim.kill.subscribe(),
            net::Running::new(&sim.servers),
        ));
    }
    if sim.cfg.role == Some(PdRole::Prefill) && sim.cfg.flavor == SimFlavor::Vllm {
        vllm::start_sweeper(sim);
    }
    if let Some(listener) = l.bootstrap {
        let s = sim.clone();
        tokio::spawn(net::serve(
            listener,
            None,
            move |req| sglang::bootstrap_server(s.clone(), req),
            shutdown.clone(),
            sim.kill.subscribe(),
            net::Running::new(&sim.servers),
        ));
    }
}

/// What a generation request asks of a role server.
#[derive(Debug, Clone)]
pub(crate) enum Leg {
    /// vLLM P: keep the prompt's blocks for a D once answered, and say where they are.
    Lend,
    /// vLLM D: pull the prompt's KV from the P its params name, then decode.
    Pull(vllm::Remote),
    /// SGLang P: prefill, then hand the room's KV to the D that asks for it.
    Send(sglang::Room),
    /// SGLang D: wait for the room's KV from its P, then decode.
    Receive(sglang::Room),
}

impl Leg {
    /// The local rank a SGLang room lands on when the request pins none:
    /// `bootstrap_room % dp_size`, as SGLang's `DataParallelController.
    /// follow_bootstrap_room_scheduler` dispatches (python/sglang/srt/managers/
    /// data_parallel_controller.py).
    pub(crate) fn room_rank(&self, dp_size: u32) -> Option<usize> {
        match self {
            Leg::Send(r) | Leg::Receive(r) => Some((r.room % u64::from(dp_size.max(1))) as usize),
            Leg::Lend | Leg::Pull(_) => None,
        }
    }

    /// Whether the P answers with one token whatever the request bounds (SGLang's P: its
    /// output is the prefill's token, D generates the rest).
    pub(crate) fn one_token(&self) -> bool {
        matches!(self, Leg::Send(_))
    }
}

/// Why a PD leg failed: the engine's answer (500, as both engines fail such a request).
pub(crate) struct PdFail {
    pub(crate) message: String,
}

impl Sim {
    /// The disaggregation leg a request asks for, read from its body (`Ok(None)`: an ordinary
    /// request); `Err((field, message))` for a malformed field, answered 400.
    pub(in crate::sim) fn pd_leg(
        &self,
        api: Api,
        body: &Value,
    ) -> Result<Option<Leg>, (String, String)> {
        let Some(role) = self.cfg.role else {
            return Ok(None);
        };
        match self.cfg.flavor {
            SimFlavor::Vllm if matches!(api, Api::Chat | Api::Completion) => vllm::leg(role, body),
            SimFlavor::Sglang if matches!(api, Api::Chat | Api::Completion | Api::Generate) => {
                sglang::leg(role, body)
            }
            _ => Ok(None),
        }
    }

    /// Before the prefill of an admitted request: a D gets the prompt's KV from its P. Returns
    /// the prompt tokens whose KV came from there (their prefill is skipped).
    pub(crate) async fn pd_before_prefill(
        &self,
        local: usize,
        leg: Option<&Leg>,
        prompt_tokens: u64,
    ) -> Result<u64, PdFail> {
        let got = match leg {
            Some(Leg::Pull(remote)) => self.pull(local, remote, prompt_tokens).await?,
            Some(Leg::Receive(room)) => self.receive(local, room, prompt_tokens).await?,
            _ => return Ok(0),
        };
        let c = &self.pd.ranks[local];
        c.external.fetch_add(got.tokens, Relaxed);
        c.bytes.fetch_add(got.bytes, Relaxed);
        c.transfers.fetch_add(1, Relaxed);
        super::pause(Duration::from_secs_f64(
            got.bytes as f64 / TRANSFER_BYTES_PER_SEC,
        ))
        .await;
        Ok(got.tokens)
    }

    /// Counts the prompt tokens a role server computed itself.
    pub(crate) fn pd_computed(&self, local: usize, tokens: u64) {
        if self.cfg.role.is_some() {
            self.pd.ranks[local]
                .local_compute
                .fetch_add(tokens, Relaxed);
        }
    }

    /// After the last token, with the request's KV still held: vLLM's P lends its blocks and
    /// returns the params naming them; SGLang's P hands the room's KV to its D (waiting for it,
    /// bounded). `Ok(None)` for every other request.
    pub(crate) async fn pd_after_decode(
        &self,
        local: usize,
        leg: Option<&Leg>,
        request_id: &str,
        prompt_tokens: u64,
        adm: &Admission<'_>,
    ) -> Result<Option<Value>, PdFail> {
        match leg {
            Some(Leg::Lend) => Ok(Some(self.lend(local, request_id, prompt_tokens, adm))),
            Some(Leg::Send(room)) => self.send(local, room, prompt_tokens).await.map(|_| None),
            _ => Ok(None),
        }
    }

    /// A failed leg's answer as the engine gives it: a 500 error body whole, or in a stream an
    /// error event followed by `[DONE]`.
    pub(crate) async fn pd_failed(
        &self,
        fail: PdFail,
        tx: Option<&mpsc::Sender<Bytes>>,
    ) -> Option<Result<Value, Value>> {
        let body = json!({"error": {"message": fail.message, "type": "InternalServerError",
            "param": null, "code": 500}});
        match tx {
            Some(tx) => {
                let _ = tx
                    .send(Bytes::from(format!("data: {body}\n\ndata: [DONE]\n\n")))
                    .await;
                None
            }
            None => Some(Err(body)),
        }
    }
}

/// How long a D may take to connect to a P's side channel or bootstrap server.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest answer a D reads from a P's side channel or bootstrap server.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

type Client = rankgate::http::HttpClient<Full<Bytes>>;

/// One JSON exchange with another engine's side channel or bootstrap server, bounded by
/// `timeout` as a whole; the answer's body as JSON (`null` when it is not).
async fn call(
    client: &Client,
    method: Method,
    url: &str,
    body: Option<Value>,
    timeout: Duration,
) -> Result<(StatusCode, Value), String> {
    let body = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
    let req = Request::builder()
        .method(method)
        .uri(url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| format!("{url}: {e}"))?;
    let exchange = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let status = resp.status();
        let bytes = Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| format!("{url}: {e}"))?
            .to_bytes();
        Ok((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| format!("{url}: no answer within {timeout:?}"))?
}

impl Sim {
    /// The client a D reaches P with, made once.
    fn pd_client(&self) -> &Client {
        self.pd
            .client
            .get_or_init(|| rankgate::http::client(CONNECT_TIMEOUT))
    }
}

/// KV that reached a D.
pub(crate) struct Got {
    tokens: u64,
    bytes: u64,
}

/// The whole blocks `tokens` of prompt take, and their bytes.
fn blocks_of(tokens: u64) -> (u64, u64) {
    let blocks = tokens.div_ceil(BLOCK_TOKENS);
    (blocks, blocks * BLOCK_TOKENS * KV_BYTES_PER_TOKEN)
}

impl SimEngine {
    /// Per local rank, the disaggregation counters.
    pub fn pd_counts(&self) -> Vec<PdCounts> {
        self.sim.pd.ranks.iter().map(RankPd::counts).collect()
    }

    /// vLLM P: per local rank, the side channel's port (what `remote_port` names).
    pub fn side_ports(&self) -> Vec<u16> {
        self.sim.pd.side_ports.clone()
    }

    /// SGLang P: the bootstrap server's port (what a router sends as `bootstrap_port`).
    pub fn bootstrap_port(&self) -> Option<u16> {
        self.sim.pd.bootstrap_port
    }

    /// vLLM: the engine id (`remote_engine_id` without its `_dp<rank>` suffix).
    pub fn engine_id(&self) -> String {
        self.sim.pd.engine_id.clone()
    }
}
