//! Why flow control answered a request itself: the reasons (the `reason` label on `/metrics`, the
//! `code` of the client's error) and the error the client is told.

use std::time::Duration;

/// Why a request was refused, in the order of [`ObjectiveStats::rejected`]: the `reason` label,
/// and the `code` of the client's error.
pub const REASONS: [&str; 5] = [
    "queue_full",
    "tenant_queue_full",
    "deadline",
    "shutting_down",
    "client_gone",
];

/// Why a request left the queue without being sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `flow.max_queued` or `flow.max_queued_bytes`.
    QueueFull,
    /// The tenant's own caps.
    TenantFull,
    /// Its wait ran past its objective's `max_wait` (or its own header's).
    Deadline,
    /// rankgate stopped with it still waiting.
    ShuttingDown,
    /// Its client went away (counted; no answer reaches anyone).
    ClientGone,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        REASONS[self as usize]
    }
}

/// A request flow control refused: 503 with `Retry-After`, its error naming the reason.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}", describe(self))]
pub struct Refused {
    pub why: Refusal,
    pub tenant: String,
    pub objective: String,
    pub waited: Duration,
}

impl Refused {
    /// What any client may read: the reason, without settings or other tenants.
    pub fn public(&self) -> &'static str {
        match self.why {
            Refusal::QueueFull => "the fleet is saturated and the queue is full; retry later",
            Refusal::TenantFull => {
                "the fleet is saturated and this tenant has its most requests waiting; retry later"
            }
            Refusal::Deadline => {
                "the fleet stayed saturated for this request's whole wait; retry later"
            }
            Refusal::ShuttingDown => {
                "shutting down with the fleet saturated: the request was never sent; retry"
            }
            Refusal::ClientGone => "the client went away",
        }
    }
}

fn describe(r: &Refused) -> String {
    let (t, o) = (&r.tenant, &r.objective);
    match r.why {
        Refusal::QueueFull => "the fleet is saturated and rankgate's queue is full (flow.max_queued, flow.max_queued_bytes); retry later".into(),
        Refusal::TenantFull => format!("the fleet is saturated and tenant `{t}` has its most requests waiting already (flow.max_queued_per_tenant, flow.max_queued_bytes_per_tenant); retry later"),
        Refusal::Deadline => format!("the fleet stayed saturated for the whole of this request's wait (it waited {} ms, objective `{o}`); retry later", r.waited.as_millis()),
        Refusal::ShuttingDown => "rankgate is shutting down and the fleet had no room for this request: it was never sent; retry".into(),
        Refusal::ClientGone => "the client went away while its request waited".into(),
    }
}
