//! The listeners' connection limits and what their clients do with them, read from each door
//! at scrape time: `rankgate_connections_max`, `rankgate_connections_per_client_max`,
//! `rankgate_connections_open`, `rankgate_connection_clients`, and the connections refused
//! (an address at its limit, all serving), replaced (closed before their first request to
//! make room for a newer one) or reclaimed (idle between requests, closed for a newer one). A flood shows here before it shows anywhere else.

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::http::{Door, DoorStats};

/// A series: its name, its help, and how it reads a door's numbers.
type Series<T> = (&'static str, &'static str, fn(&DoorStats) -> T);

/// The doors, each with its `listener` label (`front`, `admin`, `grpc`).
#[derive(Debug)]
pub(super) struct Doors(pub Vec<(&'static str, Arc<Door>)>);

impl Collector for Doors {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let stats: Vec<(&str, DoorStats)> = self.0.iter().map(|(l, d)| (*l, d.stats())).collect();
        let gauges: [Series<usize>; 4] = [
            (
                "rankgate_connections_max",
                "Client connections the listener holds at once (server.max_connections for the \
                 front doors)",
                |s| s.max_connections,
            ),
            (
                "rankgate_connections_per_client_max",
                "Client connections one client address may hold at once on the listener \
                 (server.max_connections_per_client for the front doors)",
                |s| s.max_connections_per_client,
            ),
            (
                "rankgate_connections_open",
                "Client connections open on the listener now",
                |s| s.open,
            ),
            (
                "rankgate_connection_clients",
                "Client addresses holding connections on the listener now",
                |s| s.clients,
            ),
        ];
        for (name, help, read) in gauges {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (listener, s) in &stats {
                ConstGauge::new(read(s) as i64)
                    .encode(m.encode_family(&[("listener", *listener)])?)?;
            }
        }
        let counters: [Series<u64>; 3] = [
            (
                "rankgate_connections_refused",
                "Client connections closed at their header deadline while waiting for a place: \
                 their address held its limit and every one of its connections was serving",
                |s| s.refused,
            ),
            (
                "rankgate_connections_replaced",
                "Client connections closed before their first request to make room for a newer \
                 one (their address at its limit, or the listener full)",
                |s| s.replaced,
            ),
            (
                "rankgate_connections_reclaimed",
                "Client connections idle between requests closed gracefully to make room for a \
                 newer one (their address at its limit, or the listener full)",
                |s| s.reclaimed,
            ),
        ];
        for (name, help, read) in counters {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (listener, s) in &stats {
                ConstCounter::new(read(s)).encode(m.encode_family(&[("listener", *listener)])?)?;
            }
        }
        Ok(())
    }
}
