//! A latency histogram in atomics: an observation is two relaxed adds, no lock.
//!
//! `prometheus-client`'s own histogram takes a mutex per observation; these are observed twice
//! per request (first byte, end) from every core, so they are kept in atomics instead and
//! handed to the encoder at scrape time as what it needs (bounds, counts, sum).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use prometheus_client::encoding::{MetricEncoder, NoLabelSet};

/// Upper bounds (seconds) of request latencies, from a cached answer to a 30-minute stream.
pub const BUCKETS: [f64; 20] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 1200.0, 1800.0,
];

/// Observations per bucket (the last is `+Inf`) and their sum in microseconds (an integer, so
/// adding is one atomic add; 2^64 µs is 580,000 years of streams).
#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_micros: AtomicU64,
}

impl Histogram {
    #[inline]
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = BUCKETS.partition_point(|b| *b < secs);
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_micros
            .fetch_add(d.as_micros().min(u64::MAX as u128) as u64, Relaxed);
    }

    /// Observations so far, by bucket (`+Inf` last).
    pub fn counts(&self) -> [u64; BUCKETS.len() + 1] {
        std::array::from_fn(|i| self.counts[i].load(Relaxed))
    }

    /// Observations so far.
    #[cfg(test)]
    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Relaxed)).sum()
    }

    /// Writes the buckets, `_sum` and `_count`. The count is the sum of the buckets as read, so
    /// the `+Inf` bucket always equals `_count` even while requests are being observed.
    pub fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let mut buckets = [(0.0, 0); BUCKETS.len() + 1];
        for (i, slot) in buckets.iter_mut().enumerate() {
            let bound = BUCKETS.get(i).copied().unwrap_or(f64::INFINITY);
            *slot = (bound, self.counts[i].load(Relaxed));
        }
        let count = buckets.iter().map(|b| b.1).sum();
        let sum = self.sum_micros.load(Relaxed) as f64 / 1e6;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_observation_lands_in_the_first_bucket_that_holds_it() {
        let h = Histogram::default();
        h.observe(Duration::from_millis(1));
        h.observe(Duration::from_millis(2));
        h.observe(Duration::from_secs(1800));
        h.observe(Duration::from_secs(4000));
        let c: Vec<u64> = h.counts.iter().map(|c| c.load(Relaxed)).collect();
        assert_eq!((c[0], c[1], c[19], c[20]), (1, 1, 1, 1));
        assert_eq!(h.count(), 4);
        assert_eq!(h.sum_micros.load(Relaxed), 5_800_003_000);
    }
}
