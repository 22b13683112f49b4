//! `/ready`: whether a load balancer should send this process new clients. Not while it drains;
//! otherwise when a rank is routable, unless `server.ready_requires_routable = false` asks to
//! stay in through a fleet-wide outage (rankgate then answers clients' requests with its own 503
//! and `Retry-After`, which a load balancer with no endpoint left cannot).

use std::sync::atomic::Ordering::Relaxed;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;

use super::Admin;
use crate::http::respond;

impl Admin {
    pub(super) fn ready(&self) -> Response<Full<Bytes>> {
        let (status, body) = if self.draining.load(Relaxed) {
            (StatusCode::SERVICE_UNAVAILABLE, "draining: shutting down\n")
        } else if (self.selector).any_front_routable(&self.table, self.grpc_front) {
            (StatusCode::OK, "ready\n")
        } else if self.ready_requires_routable {
            (StatusCode::SERVICE_UNAVAILABLE, "no routable rank yet\n")
        } else {
            (
                StatusCode::OK,
                "ready, but no rank is routable: requests get 503 (server.ready_requires_routable = false)\n",
            )
        };
        respond(status, "text/plain", body)
    }
}
