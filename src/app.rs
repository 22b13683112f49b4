//! Assembly: binds the listeners, starts the telemetry monitor, the front door and the admin
//! listener, and stops them all on one signal. `main`, the demo and the tests all start rankgate
//! through [`Router::start`], so what the tests exercise is what runs.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::admin::Admin;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::policy::Selector;
use crate::proxy::Proxy;
use crate::table::Table;
use crate::telemetry::{self, TelemetryStats};
use crate::worker::Fleet;

#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {key} = {addr}: {source}")]
pub struct StartError {
    key: &'static str,
    addr: SocketAddr,
    source: std::io::Error,
}

/// A running rankgate.
pub struct Router {
    /// Where the OpenAI-compatible front door listens (the bound port when the config said 0).
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub table: Arc<Table>,
    pub metrics: Arc<Metrics>,
    pub selector: Arc<Selector>,
    shutdown: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

async fn bind(key: &'static str, addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| StartError { key, addr, source })
}

impl Router {
    /// Binds both listeners and starts serving. Returns once the ports are bound.
    pub async fn start(cfg: Config) -> Result<Router, StartError> {
        let listener = bind("server.listen", cfg.server.listen).await?;
        let admin_listener = bind("server.admin_listen", cfg.server.admin_listen).await?;
        let addr = listener.local_addr().map_err(|source| StartError {
            key: "server.listen",
            addr: cfg.server.listen,
            source,
        })?;
        let admin_addr = admin_listener.local_addr().map_err(|source| StartError {
            key: "server.admin_listen",
            addr: cfg.server.admin_listen,
            source,
        })?;

        let fleet = Fleet::expand(cfg.engines.clone());
        let table = Table::new(fleet, cfg.telemetry.stale_after);
        let metrics = Arc::new(Metrics::new(table.fleet.workers.len()));
        let stats = Arc::new(TelemetryStats::new(table.fleet.workers.len()));
        let (shutdown, rx) = watch::channel(false);
        let mut tasks = JoinSet::new();

        let monitor = telemetry::spawn(
            table.clone(),
            cfg.telemetry.clone(),
            cfg.routing.request_kv_estimate,
            stats.clone(),
            rx.clone(),
        );
        tasks.spawn(async move {
            let _ = monitor.await;
        });

        let proxy = Arc::new(Proxy::new(&cfg, table.clone(), metrics.clone()));
        let selector = proxy.selector().clone();
        tasks.spawn(crate::http::serve(
            listener,
            move |req| proxy.clone().handle(req),
            rx.clone(),
        ));
        let admin = Arc::new(Admin {
            table: table.clone(),
            metrics: metrics.clone(),
            telemetry: stats,
            selector: selector.clone(),
        });
        tasks.spawn(crate::http::serve(
            admin_listener,
            move |req| admin.clone().handle(req),
            rx,
        ));
        tracing::info!(
            %addr, %admin_addr, workers = table.fleet.workers.len(),
            policy = cfg.routing.policy.as_str(), "rankgate serving"
        );
        Ok(Router {
            addr,
            admin_addr,
            table,
            metrics,
            selector,
            shutdown,
            tasks,
        })
    }

    /// Stops accepting, lets requests in flight finish (within the drain grace), then returns.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        while self.tasks.join_next().await.is_some() {}
    }
}
