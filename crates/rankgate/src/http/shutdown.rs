//! The shutdown signal every long-running task of the router watches: a `watch` channel that
//! turns `true` once, and the wait for it. A leaf, so tasks far from the accept loop (discovery,
//! telemetry) and the loop's own parts share it without importing one another.

use tokio::sync::watch;

/// A shutdown signal: `true` once shutdown is asked for.
pub type Shutdown = watch::Receiver<bool>;

/// Resolves when `shutdown` flips to true (or its sender is gone).
pub async fn shutdown_signalled(shutdown: &mut Shutdown) {
    while !*shutdown.borrow_and_update() {
        if shutdown.changed().await.is_err() {
            return;
        }
    }
}
