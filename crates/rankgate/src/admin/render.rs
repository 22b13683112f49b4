//! The admin API's fleet-wide renders (`/metrics`, `/workers`, `/engines`, `/loads`), run off
//! the runtime's threads so that the probes answered beside them never wait.

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;

use crate::http::openai_error;

/// Renders of the whole fleet (`/metrics`, `/workers`, `/engines`, `/loads`) at once: each is
/// done on the blocking pool, at most this many at a time, so that a scrape of a huge fleet, or
/// many of them, never holds the runtime's threads that answer `/ready` and `/health` (which
/// read the snapshot and take no lock: they never wait behind the admin API's work).
pub(super) const RENDERS_AT_ONCE: usize = 2;

/// One router's renders in progress (its own: several routers in one process, as in tests, never
/// wait on each other's).
pub struct Renders(tokio::sync::Semaphore);

impl Default for Renders {
    fn default() -> Renders {
        Renders(tokio::sync::Semaphore::new(RENDERS_AT_ONCE))
    }
}

/// Runs `render` off the runtime's threads, within [`RENDERS_AT_ONCE`] of `renders`.
pub(super) async fn off_runtime(
    renders: &Renders,
    render: impl FnOnce() -> Response<Full<Bytes>> + Send + 'static,
) -> Response<Full<Bytes>> {
    let unavailable = || {
        openai_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            "the admin render did not finish",
        )
    };
    let Ok(_permit) = renders.0.acquire().await else {
        return unavailable();
    };
    tokio::task::spawn_blocking(render)
        .await
        .unwrap_or_else(|_| unavailable())
}
