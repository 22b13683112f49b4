//! `rankgate_route_requests_total{route, target}`: requests a model route (`[[routes]]`) sent to
//! each target, read at scrape time from the counters of the current snapshot's routes. The
//! labels come from the config (at most `config::MAX_ROUTES` routes of `config::MAX_TARGETS`
//! targets), never from a request; a route or target a reload removed leaves the page with it,
//! and one that stays counts on ([`crate::model_routes::Routes::carry`]).

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;

use crate::table::Table;

#[derive(Debug)]
pub(super) struct ModelRoutes {
    pub table: Arc<Table>,
}

impl Collector for ModelRoutes {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let snap = self.table.snapshot.load();
        let routes = snap.catalog.routes();
        // No routes, no family: a fleet without `[[routes]]` shows nothing of them.
        if routes.is_empty() {
            return Ok(());
        }
        let mut m = enc.encode_descriptor(
            "rankgate_route_requests",
            "Requests naming a model route ([[routes]]), by the route's name and the target \
             model they were sent to (their requests' other series count them under the target)",
            None,
            MetricType::Counter,
        )?;
        for route in routes.iter() {
            for t in route.targets.iter() {
                let labels = [("route", &*route.name), ("target", &*t.model)];
                ConstCounter::new(t.served()).encode(m.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}
