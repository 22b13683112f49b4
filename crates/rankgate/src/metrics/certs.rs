//! `rankgate_tls_cert_expiry_timestamp_seconds{listener}`: when each TLS listener's served
//! certificate expires, read from the listener at scrape time, so a reload's new certificate
//! shows at the next scrape. An alert on it warns of the end without waiting for a reload's
//! log line.

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::tls::ServerTls;

#[derive(Debug)]
pub(super) struct Certificates {
    pub listeners: Vec<Arc<ServerTls>>,
}

impl Collector for Certificates {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let known: Vec<(&'static str, i64)> = (self.listeners.iter())
            .filter_map(|l| Some((l.key(), l.not_after()?)))
            .collect();
        if known.is_empty() {
            return Ok(());
        }
        let mut m = enc.encode_descriptor(
            "rankgate_tls_cert_expiry_timestamp_seconds",
            "When the certificate a TLS listener serves expires (its notAfter), in seconds \
             since the epoch, by listener: server.tls or server.admin_tls",
            None,
            MetricType::Gauge,
        )?;
        for (listener, at) in known {
            ConstGauge::new(at).encode(m.encode_family(&[("listener", listener)])?)?;
        }
        Ok(())
    }
}
