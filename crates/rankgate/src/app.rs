//! Assembly: binds the listeners, starts the telemetry monitor, the front door and the admin
//! listener, and stops them all on one signal. `main`, the demo and the tests all start rankgate
//! through [`Router::start`], so what the tests exercise is what runs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::Admin;
use crate::config::Config;
use crate::control::Control;
use crate::http::{Door, ServeOptions, Share};
use crate::membership::{Membership, Sources};
use crate::metrics::Metrics;
use crate::policy::Selector;
use crate::proxy::{Keys, KeysError, Layers};
use crate::table::Table;
use crate::telemetry;
use crate::tls::{ServerTls, Upstream};
use crate::upstream::{ConnLimits, Cutoff};
use crate::worker::{EngineEntry, Fleet, Origin};

/// Why rankgate could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {key} = {addr}: {source}")]
    Listen {
        key: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// The client keys `[server]` points at could not be read (names where, never a key).
    #[error(transparent)]
    Keys(#[from] KeysError),
    /// A certificate, key or CA file of the TLS settings could not be used.
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    /// A model's tokenizer (`[[models]]`) could not be loaded.
    #[error(transparent)]
    Tokenizer(#[from] crate::prompt::LoadError),
    /// A front door thread (thread-per-core) could not be started.
    #[error("cannot start the front door's thread for core {core}: {source}")]
    Thread { core: usize, source: std::io::Error },
}

impl StartError {
    /// A file the config names could not be used (keys, certificates): a config error, as
    /// `rankgate check` reports it, rather than a failure of the machine.
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            StartError::Keys(_) | StartError::Tls(_) | StartError::Tokenizer(_)
        )
    }
}

/// How long the front door waits, once the engine connections are cut, for the cut streams'
/// last events to reach their clients before it closes the connections still open.
pub const CUT_FLUSH: Duration = Duration::from_secs(1);

/// Cuts a router's streams at once (see [`Router::cut_handle`]).
pub struct Cut {
    cutoff: Cutoff,
    table: Arc<Table>,
    flows: Option<Arc<crate::proxy::Flows>>,
}

impl Cut {
    /// Cuts every engine connection, then waits (at most [`CUT_FLUSH`]) until no request is in
    /// flight and the cut streams' last events have had a moment to go out.
    pub async fn now(self) {
        self.flows.iter().for_each(|f| f.close());
        self.cutoff.cut();
        let flushed = async {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            loop {
                tick.tick().await;
                let snap = self.table.snapshot.load();
                if snap.fleet.workers.iter().all(|w| w.live.in_flight() == 0) {
                    break;
                }
            }
            // A body lets go of its request as it yields its last event: give the
            // connection a moment to write it.
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let _ = tokio::time::timeout(CUT_FLUSH, flushed).await;
    }
}

/// A running rankgate.
pub struct Router {
    /// Where the OpenAI-compatible front door listens (the bound port when the config said 0).
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// Where the gRPC front door listens, if `server.grpc_listen` is set.
    pub grpc_addr: Option<SocketAddr>,
    pub table: Arc<Table>,
    pub metrics: Arc<Metrics>,
    pub selector: Arc<Selector>,
    /// Changes the fleet at runtime.
    pub membership: Membership,
    control: Arc<Control>,
    /// Set once shutdown begins: `/ready` answers 503 from then on.
    draining: Arc<AtomicBool>,
    shutdown_delay: Duration,
    /// `server.drain_grace`: when it ends, the engine connections are cut ([`Cutoff`]).
    drain_grace: Duration,
    cutoff: Cutoff,
    /// Flow control's queue: what still waits when the drain grace ends is answered 503.
    flows: Option<Arc<crate::proxy::Flows>>,
    /// Stops the front doors' accept loops (their connections then drain).
    stop_front: watch::Sender<bool>,
    /// Stops telemetry and the admin listener, once the front door has drained.
    stop_rest: watch::Sender<bool>,
    front: Vec<JoinHandle<()>>,
    rest: Vec<JoinHandle<()>>,
    /// The listeners' TLS certificates, reloaded on SIGHUP and when their files change.
    certificates: Vec<Arc<ServerTls>>,
}

async fn bind(key: &'static str, addr: SocketAddr) -> Result<TcpListener, StartError> {
    bind_shared(key, addr, Share::No)
}

/// [`bind`], sharing the port as `share` says (see [`crate::http::listen`]).
fn bind_shared(
    key: &'static str,
    addr: SocketAddr,
    share: Share,
) -> Result<TcpListener, StartError> {
    crate::http::listen(addr, share).map_err(|source| StartError::Listen { key, addr, source })
}

/// Thread-per-core: the HTTP front door on one single-threaded runtime per core the process may
/// run on, each with its own `SO_REUSEPORT` listener on `addr` and its own engine connection
/// pool; the snapshot, the per-rank counters and everything else stay shared. A request never
/// leaves the thread that accepted it (no work stealing, no wake-ups across threads). Each
/// returned task ends when its thread's front door has drained.
fn serve_per_core(
    first: TcpListener,
    addr: SocketAddr,
    layers: &Arc<crate::proxy::Layers>,
    shutdown: watch::Receiver<bool>,
    opts: &ServeOptions,
) -> Result<Vec<JoinHandle<()>>, StartError> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // `first` is bound (alone, then shared: `Share::Lead`); the other cores' join its port.
    let others = (1..cores).map(|_| bind_shared("server.listen", addr, Share::Join));
    let listeners = std::iter::once(Ok(first))
        .chain(others)
        .collect::<Result<Vec<_>, _>>()?;
    // One cap (it guards the process's file descriptors), one count per client address and
    // one set of log throttles for all the cores' listeners: the door in `opts`.
    let mut done = Vec::new();
    for (core, listener) in listeners.into_iter().enumerate() {
        let thread = |source| StartError::Thread { core, source };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(thread)?;
        // A tokio listener belongs to the runtime that registered it: moved over to this
        // core's (within the guard, tokio's "current runtime" is the core's).
        let listener = {
            let _on_core = rt.enter();
            let std = listener.into_std().map_err(thread)?;
            TcpListener::from_std(std).map_err(thread)?
        };
        let (layers, shutdown, opts) = (layers.clone(), shutdown.clone(), opts.clone());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(format!("rankgate-core-{core}"))
            .spawn(move || {
                rt.block_on(async move {
                    crate::http::serve_with(
                        listener,
                        move |peer| crate::proxy::stack(&layers, core, peer),
                        shutdown,
                        opts,
                    )
                    .await;
                });
                let _ = tx.send(());
            })
            .map_err(thread)?;
        done.push(tokio::spawn(async move {
            let _ = rx.await;
        }));
    }
    tracing::info!(cores = done.len(), "front door: one runtime per core");
    Ok(done)
}

/// `opts` with a door of its own, which its listeners share.
fn with_door(opts: ServeOptions) -> ServeOptions {
    ServeOptions {
        door: Some(Arc::new(Door::new(&opts))),
        ..opts
    }
}

fn door_of(opts: &ServeOptions) -> Arc<Door> {
    (opts.door.clone()).unwrap_or_else(|| Arc::new(Door::new(opts)))
}

impl Router {
    /// Binds the listeners and starts serving. Returns once the ports are bound.
    pub async fn start(cfg: Config) -> Result<Router, StartError> {
        Router::start_from(cfg, None).await
    }

    /// [`Router::start`] for a config read from `path`, which reloads re-read.
    pub async fn start_from(cfg: Config, path: Option<PathBuf>) -> Result<Router, StartError> {
        // Before any port binds: a key source that cannot be read must stop the start, never
        // leave the door open (or a load balancer routing to a router that refuses everyone).
        let keys = Keys::load(&cfg.server, &cfg.flow)?;
        if let Some(k) = &keys {
            tracing::info!(keys = ?k, "client API keys required");
        }
        // Certificates too: a listener that cannot serve TLS must not open in cleartext.
        let front_tls = (cfg.server.tls.as_ref())
            .map(|t| ServerTls::load("server.tls", t))
            .transpose()?;
        let admin_tls = (cfg.server.admin_tls.as_ref())
            .map(|t| ServerTls::load("server.admin_tls", t))
            .transpose()?;
        let upstream = Upstream::load(&cfg.engine_tls)?;
        // Thread-per-core: the first of the cores' listeners, bound alone then shared.
        let share = match cfg.server.thread_per_core {
            true => Share::Lead,
            false => Share::No,
        };
        let listener = bind_shared("server.listen", cfg.server.listen, share)?;
        let admin_listener = bind("server.admin_listen", cfg.server.admin_listen).await?;
        let grpc_listener = match cfg.server.grpc_listen {
            Some(a) => Some(bind("server.grpc_listen", a).await?),
            None => None,
        };
        let grpc_addr = grpc_listener
            .as_ref()
            .map(|l| {
                l.local_addr().map_err(|source| StartError::Listen {
                    key: "server.grpc_listen",
                    addr: cfg.server.grpc_listen.unwrap_or(cfg.server.listen),
                    source,
                })
            })
            .transpose()?;
        let addr = listener.local_addr().map_err(|source| StartError::Listen {
            key: "server.listen",
            addr: cfg.server.listen,
            source,
        })?;
        let admin_addr = admin_listener
            .local_addr()
            .map_err(|source| StartError::Listen {
                key: "server.admin_listen",
                addr: cfg.server.admin_listen,
                source,
            })?;

        let limits = ConnLimits::of(&cfg.server);
        let fleet = Fleet::new(
            (cfg.engines.iter())
                .map(|e| EngineEntry::new(e.clone(), Origin::Config, limits, None))
                .collect(),
        );
        // Engines that leave their flavor or DP size to the engine have no workers until it
        // answers (a moment later): the start line counts them apart, and each one's "engine
        // said its shape" line gives the fleet's count then.
        let (engines, workers) = (fleet.engines.len(), fleet.workers.len());
        let engines_pending_shape = fleet.engines.iter().filter(|e| !e.shaped()).count();
        let table = Table::routed(fleet, cfg.telemetry.stale_after, cfg.routes.clone());
        // The doors first: /metrics shows their limits and counts, the allocator trim watches
        // their connections come and go.
        let front_opts = with_door(ServeOptions {
            tls: front_tls.clone(),
            // The drain grace ends here with the engine connections cut (see `shutdown`);
            // the front door waits a moment more for the cut streams' last events to go out
            // before it closes what is left.
            drain_grace: cfg.server.drain_grace + CUT_FLUSH,
            ..ServeOptions::front_door(&cfg.server)
        });
        let grpc_opts = with_door(front_opts.clone());
        let admin_opts = with_door(ServeOptions {
            tls: admin_tls.clone(),
            ..ServeOptions::admin()
        });
        let mut doors = vec![
            ("front", door_of(&front_opts)),
            ("admin", door_of(&admin_opts)),
        ];
        if grpc_listener.is_some() {
            doors.push(("grpc", door_of(&grpc_opts)));
        }
        let certificates: Vec<_> = (front_tls.iter()).chain(&admin_tls).cloned().collect();
        let metrics = Arc::new(Metrics::for_router(
            table.clone(),
            &cfg.server.extra_routes,
            doors.clone(),
            certificates.clone(),
        ));
        let (stop_front, front_rx) = watch::channel(false);
        let (stop_rest, rest_rx) = watch::channel(false);

        let (membership, changes) = Membership::channel();
        let control = Arc::new(Control::new(&cfg, path, membership.clone()));
        let discovery = crate::discovery::spawn(&cfg.discovery, &membership, &rest_rx);
        let monitor = telemetry::spawn(
            table.clone(),
            Sources::new(cfg.engines.clone()),
            telemetry::Settings {
                telemetry: cfg.telemetry.clone(),
                default_kv_per_request: cfg.routing.request_kv_estimate,
                limits,
                upstream: upstream.clone(),
                kv_events: cfg.routing.kv_events,
            },
            changes,
            rest_rx.clone(),
        );

        let memory = crate::memory::spawn(
            table.clone(),
            doors.iter().map(|(_, d)| d.clone()).collect(),
            rest_rx.clone(),
        );
        let prompts = crate::prompt::Prompts::load(&cfg.models)?;
        let layers = Layers::new(
            &cfg,
            table.clone(),
            metrics.clone(),
            keys,
            &upstream,
            prompts,
        );
        let selector = layers.shared().selector.clone();
        let flows = layers.flows().cloned();
        let dispatch = flows.as_ref().map(|f| {
            metrics.add_late(crate::proxy::flow_collector(f));
            tokio::spawn(f.clone().run(rest_rx.clone()))
        });
        let mut front = if cfg.server.thread_per_core {
            serve_per_core(listener, addr, &layers, front_rx.clone(), &front_opts)?
        } else {
            vec![tokio::spawn(crate::http::serve_with(
                listener,
                {
                    let layers = layers.clone();
                    move |peer| crate::proxy::stack(&layers, 0, peer)
                },
                front_rx.clone(),
                front_opts.clone(),
            ))]
        };
        // Idle engine connections are closed after a while even when no request comes by.
        tokio::spawn(crate::proxy::sweep_idle_connections(
            table.clone(),
            front_rx.clone(),
        ));
        // The fleet's first-byte bound, which tells a hung request from a slow fleet.
        crate::proxy::watch_first_bytes(&metrics, &cfg.routing, front_rx.clone());
        if let Some(l) = grpc_listener {
            front.push(tokio::spawn(crate::http::serve_with(
                l,
                {
                    let layers = layers.clone();
                    move |peer| crate::proxy::grpc_stack(&layers, peer)
                },
                front_rx,
                grpc_opts,
            )));
        }
        let draining = layers.draining().clone();
        let admin = Arc::new(Admin {
            table: table.clone(),
            metrics: metrics.clone(),
            selector: selector.clone(),
            draining: draining.clone(),
            control: control.clone(),
            grpc_front: grpc_addr.is_some(),
            ready_requires_routable: cfg.server.ready_requires_routable,
            renders: Default::default(),
            flows: flows.clone(),
            loader: layers.shared().loader.clone(),
        });
        let admin_task = tokio::spawn(crate::http::serve_with(
            admin_listener,
            move |_| {
                let admin = admin.clone();
                tower::service_fn(move |req| admin.clone().handle(req))
            },
            rest_rx.clone(),
            admin_opts,
        ));
        let tls_watch = tokio::spawn(crate::tls::watch(certificates.clone(), {
            let mut stop = rest_rx;
            async move { crate::http::shutdown_signalled(&mut stop).await }
        }));
        tracing::info!(
            %addr, %admin_addr, grpc_addr = ?grpc_addr, engines, workers, engines_pending_shape,
            tls = cfg.server.tls.is_some(), admin_tls = cfg.server.admin_tls.is_some(),
            policy = cfg.routing.policy.as_str(),
            max_connections = front_opts.max_connections,
            max_connections_per_client = front_opts.max_connections_per_client,
            "rankgate serving"
        );
        Ok(Router {
            addr,
            admin_addr,
            grpc_addr,
            table,
            metrics,
            selector,
            membership,
            control,
            draining,
            shutdown_delay: cfg.server.shutdown_delay,
            drain_grace: cfg.server.drain_grace,
            cutoff: layers.cutoff().clone(),
            flows,
            stop_front,
            stop_rest,
            front,
            certificates,
            rest: [monitor, admin_task, memory, tls_watch]
                .into_iter()
                .chain(discovery)
                .chain(dispatch)
                .collect(),
        })
    }

    /// Re-reads the config file and applies its engines (SIGHUP).
    pub async fn reload(&self) -> Result<crate::control::Reloaded, crate::control::ReloadError> {
        self.control.reload().await
    }

    /// Re-reads the listeners' certificates (SIGHUP); a failure keeps the one in use, logged.
    pub fn reload_certificates(&self) {
        for tls in &self.certificates {
            tls.reload_logged();
        }
    }

    /// What a second signal does while [`Router::shutdown`] runs: cuts every stream still running,
    /// each ending as a broken stream does for its client (SSE's error event, gRPC's status).
    pub fn cut_handle(&self) -> Cut {
        Cut {
            cutoff: self.cutoff.clone(),
            table: self.table.clone(),
            flows: self.flows.clone(),
        }
    }

    /// Turns `/ready` to 503, so load balancers stop sending new clients; serving goes on.
    pub fn begin_drain(&self) {
        self.draining.store(true, Relaxed);
    }

    /// The rollout's shutdown: `/ready` turns 503 at once; new connections are still accepted
    /// for `server.shutdown_delay` (while endpoints update), then accepting stops and requests
    /// and streams in flight get up to `server.drain_grace` to finish; then everything stops.
    pub async fn shutdown(self) {
        self.begin_drain();
        if !self.shutdown_delay.is_zero() {
            tracing::info!(
                delay_ms = self.shutdown_delay.as_millis() as u64,
                "draining: still accepting until endpoints update"
            );
            tokio::time::sleep(self.shutdown_delay).await;
        }
        let _ = self.stop_front.send(true);
        let mut front = std::pin::pin!(async {
            for task in self.front {
                let _ = task.await;
            }
        });
        if tokio::time::timeout(self.drain_grace, &mut front)
            .await
            .is_err()
        {
            tracing::warn!("drain grace expired with streams still running: cutting them");
            self.flows.iter().for_each(|f| f.close());
            self.cutoff.cut();
            front.await;
        }
        let _ = self.stop_rest.send(true);
        for task in self.rest {
            let _ = task.await;
        }
    }
}
