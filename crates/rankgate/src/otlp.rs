//! OTLP export of the `rankgate::trace` spans (feature `otlp`, `[tracing] otlp_endpoint`): the
//! OpenTelemetry SDK's batch processor sends them as OTLP/HTTP protobuf to a collector.
//!
//! The batch processor exports from a thread of its own, outside the async runtime; its HTTP
//! requests are spawned onto rankgate's runtime and sent with rankgate's own hyper client (no
//! second HTTP stack, no TLS). Spans continue the client's trace (its `traceparent`), and the
//! engine is told each attempt's span as its parent, so the engine's own spans nest under the
//! attempt that reached it.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use opentelemetry::trace::{
    SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider as _,
};
use opentelemetry_http::{HttpClient, HttpError};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use crate::config::TracingConfig;
use crate::tracecontext::{traceparent as header, TraceContext};

/// How long one export may take: a collector that does not answer costs spans, never requests.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// A collector's answer is a short status; anything longer is not read.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// The running export: flushed and stopped by [`Export::shutdown`].
pub struct Export {
    provider: SdkTracerProvider,
}

impl Export {
    /// Sends the spans still queued and stops. Blocks: call it outside the runtime's tasks
    /// while the runtime still runs (its workers send the last batch).
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            eprintln!("rankgate: OTLP export: flushing the last spans failed: {e}");
        }
    }
}

/// The layer exporting `rankgate::trace` spans to `cfg.otlp_endpoint`, or `None` when export
/// is off.
pub fn layer<S>(
    cfg: &TracingConfig,
    runtime: tokio::runtime::Handle,
) -> Result<Option<(impl Layer<S>, Export)>, String>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    let Some(endpoint) = &cfg.otlp_endpoint else {
        return Ok(None);
    };
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(Duration::from_secs(5)));
    connector.set_nodelay(true);
    let client = Sender {
        runtime,
        client: Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector),
        endpoint: endpoint.clone(),
        failures: std::sync::Arc::new(crate::http::Throttle::new(Duration::from_secs(30))),
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_endpoint(endpoint.as_str())
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|e| format!("tracing.otlp_endpoint {endpoint}: {e}"))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(cfg.service_name.clone())
        .build();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            cfg.sample_ratio,
        ))))
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("rankgate");
    // Only the request and upstream spans: never a library's, never log events.
    let only_ours = Targets::new().with_target("rankgate::trace", LevelFilter::INFO);
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(only_ours);
    Ok(Some((layer, Export { provider })))
}

/// Makes `span` (a request's) the child of the client's span, when it sent one; returns the
/// trace id the span is exported under (the client's, or the one the SDK started).
pub fn continue_trace(span: &Span, tc: &TraceContext) -> u128 {
    if let Some(parent) = tc.parent {
        let flags = if tc.sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        let remote = SpanContext::new(
            TraceId::from(tc.trace_id),
            SpanId::from(parent),
            flags,
            true,
            TraceState::default(),
        );
        let cx = opentelemetry::Context::new().with_remote_span_context(remote);
        // Fails only without the OTLP layer (export off): then nothing is exported anyway.
        let _ = span.set_parent(cx);
    }
    let cx = span.context();
    let id = cx.span().span_context().trace_id();
    match id == TraceId::INVALID {
        true => tc.trace_id,
        false => u128::from_be_bytes(id.to_bytes()),
    }
}

/// The `traceparent` naming `span` (an attempt's) as the engine's parent; `None` when the span
/// is not exported.
pub fn traceparent(span: &Span) -> Option<HeaderValue> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| {
        header(
            u128::from_be_bytes(sc.trace_id().to_bytes()),
            u64::from_be_bytes(sc.span_id().to_bytes()),
            sc.is_sampled(),
        )
    })
}

/// The exporter's HTTP client: each request runs as a task on rankgate's runtime. Failed
/// exports are logged here (one line per 30 s at most): the SDK itself logs nothing, and spans
/// silently lost would leave an operator wondering where the traces went.
#[derive(Debug, Clone)]
struct Sender {
    runtime: tokio::runtime::Handle,
    client: Client<HttpConnector, Full<Bytes>>,
    endpoint: String,
    failures: std::sync::Arc<crate::http::Throttle>,
}

impl Sender {
    fn failed(&self, why: &str) {
        if let Some(held) = self.failures.allow() {
            tracing::warn!(
                target: "rankgate::otlp",
                endpoint = %self.endpoint, error = why, similar_since_last = held,
                "OTLP export failed: these spans are lost"
            );
        }
    }
}

#[async_trait::async_trait]
impl HttpClient for Sender {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let request = request.map(Full::new);
        let call = async move {
            let resp = tokio::time::timeout(EXPORT_TIMEOUT, client.request(request))
                .await
                .map_err(|_| format!("no answer within {} s", EXPORT_TIMEOUT.as_secs()))?
                .map_err(|e| e.to_string())?;
            let (parts, body) = resp.into_parts();
            let body = tokio::time::timeout(
                EXPORT_TIMEOUT,
                Limited::new(body, MAX_ANSWER_BYTES).collect(),
            )
            .await
            .map_err(|_| "the collector's answer stalled".to_string())?
            .map_err(|e| e.to_string())?
            .to_bytes();
            Ok::<_, String>(Response::from_parts(parts, body))
        };
        let result = match self.runtime.spawn(call).await {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(format!("the export task ended: {e}")),
        };
        match &result {
            Ok(resp) if !resp.status().is_success() => {
                self.failed(&format!("the collector answered {}", resp.status()))
            }
            Ok(_) => {}
            Err(e) => self.failed(e),
        }
        result.map_err(Into::into)
    }
}
