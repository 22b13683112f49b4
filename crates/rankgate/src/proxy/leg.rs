//! What a disaggregated request's legs were, as the access log tells them: the prefill rank,
//! how long its leg took, where the decode pulls the KV from, and how many attempts each leg
//! made. Carried with the decode leg's answer, or with its failure ([`super::error`]), up to
//! `respond`. A file of its own so that both can name it without importing each other.

use std::sync::Arc;

/// What the prefill leg of a disaggregated request was: carried in the decode leg's answer (in
/// its body's holds) up to `respond`, for the access log and the decode leg's time to first
/// byte.
#[derive(Debug, Clone)]
pub struct PrefillLeg {
    /// The prefill rank.
    pub worker: Arc<str>,
    /// The prefill leg, retries and the reading of its answer included.
    pub took: std::time::Duration,
    /// When the decode leg began.
    pub decode_started: tokio::time::Instant,
    /// Where the decode pulls the KV from, as the prefill server named it
    /// (`<remote_engine_id>:<remote_port>`; SGLang: the bootstrap address and room).
    pub kv_from: Option<Arc<str>>,
    /// Attempts on prefill ranks, every round of the request's legs included.
    pub prefill_attempts: u32,
    /// Attempts on decode ranks, every round included.
    pub decode_attempts: u32,
    /// The decode leg failed: its answer is rankgate's error, whose first byte is no decode's.
    pub decode_failed: bool,
}
