//! What the request path and the scrape-time collectors share: the label names and the series
//! kept per model. A leaf, so the collectors read it without importing the `metrics` parent.

use super::counts::RequestCounts;
use super::labels::Models;
use super::routes::Routes;

/// What the collectors read besides the snapshot: the label names and the series kept per model.
#[derive(Debug)]
pub(super) struct Core {
    pub(super) routes: Routes,
    pub(super) models: Models,
    /// Requests rankgate answered itself, without a worker.
    pub(super) local: RequestCounts,
}
