//! An engine's telemetry sources as the poller reads them: each source ready to be read, what
//! it answered before projection, and the state of one taken out of the polls after a failure.

use super::client::{fetch, Failure, HttpClient};
use super::grpc::LoadsClient;
use super::loads::LoadsReport;
use crate::config::SourceKind;

/// A source, ready to be read.
#[derive(Clone)]
pub(super) enum Source {
    Grpc(Box<LoadsClient>),
    Http(http::Uri),
    Prometheus(http::Uri),
}

impl Source {
    pub(super) fn kind(&self) -> SourceKind {
        match self {
            Source::Grpc(_) => SourceKind::Grpc,
            Source::Http(_) => SourceKind::Http,
            Source::Prometheus(_) => SourceKind::Prometheus,
        }
    }
}

/// A source taken out of the polls, and its background probe.
pub(super) struct Down {
    /// Polls between probes; doubles after each failed probe.
    pub(super) every: u32,
    /// Polls until the next probe starts.
    pub(super) wait: u32,
    pub(super) probe: Option<tokio::task::JoinHandle<bool>>,
}

/// What a source answered, before projection.
pub(super) enum Raw {
    Metrics(String),
    Loads(LoadsReport),
}

/// Reads one source. Free of the poller so a background probe can run it.
pub(super) async fn fetch_source(src: Source, http: HttpClient) -> Result<Raw, Failure> {
    match src {
        Source::Prometheus(u) => {
            let body = fetch(&http, u).await?;
            String::from_utf8(body.to_vec())
                .map(Raw::Metrics)
                .map_err(|_| Failure {
                    answered: true,
                    reason: "body is not UTF-8".into(),
                    status: None,
                })
        }
        Source::Http(u) => {
            let body = fetch(&http, u).await?;
            LoadsReport::from_json(&body)
                .map(Raw::Loads)
                .map_err(|reason| Failure {
                    answered: true,
                    reason,
                    status: None,
                })
        }
        // The gRPC port answering says nothing of the HTTP port traffic goes to, so a gRPC
        // failure never counts as the engine being reachable.
        Source::Grpc(client) => client
            .get_loads(None)
            .await
            .map(Raw::Loads)
            .map_err(Failure::silent),
    }
}

pub(super) fn uri(s: &str) -> Result<http::Uri, String> {
    s.parse().map_err(|e| format!("{s:?}: {e}"))
}
