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

static RENDERS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(RENDERS_AT_ONCE);

/// Runs `render` off the runtime's threads, within [`RENDERS_AT_ONCE`].
pub(super) async fn off_runtime(
    render: impl FnOnce() -> Response<Full<Bytes>> + Send + 'static,
) -> Response<Full<Bytes>> {
    let unavailable = || {
        openai_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            "the admin render did not finish",
        )
    };
    let Ok(_permit) = RENDERS.acquire().await else {
        return unavailable();
    };
    tokio::task::spawn_blocking(render)
        .await
        .unwrap_or_else(|_| unavailable())
}
