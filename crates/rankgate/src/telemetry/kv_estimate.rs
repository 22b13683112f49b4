//! Each rank's estimated KV cost of one more request, set on every snapshot: what the pick and
//! saturation credit for requests the engine has not reported yet.

use crate::table::{RankTelemetry, RankView};

/// Sets each rank's estimated KV cost of one more request, used to credit requests the engine has
/// not reported yet. A rank with running requests uses its own KV per request. Otherwise the cost
/// is the fleet's typical request size taken relative to THIS rank's capacity where capacities are
/// known (a rank with half the KV tokens fills twice as fast), else the fleet's mean fraction,
/// else the configured default.
pub(super) fn estimate_kv_per_request(views: &mut [RankView], default: f64) {
    struct Sample {
        fraction: Option<f64>,
        tokens: Option<f64>,
        capacity: Option<f64>,
    }
    let sample = |v: &RankView| match &v.telemetry {
        RankTelemetry::Available(l) => {
            let capacity = l.capacity_tokens.map(|c| c as f64);
            let fraction = match l.running {
                Some(r) if r > 0 && l.kv_usage > 0.0 => {
                    Some((l.kv_usage / r as f64).clamp(1e-4, 1.0))
                }
                _ => None,
            };
            Sample {
                fraction,
                tokens: fraction.zip(capacity).map(|(f, c)| f * c),
                capacity,
            }
        }
        RankTelemetry::Unavailable { .. } => Sample {
            fraction: None,
            tokens: None,
            capacity: None,
        },
    };
    let samples: Vec<Sample> = views.iter().map(sample).collect();
    let mean = |xs: Vec<f64>| (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64);
    let fleet_fraction =
        mean(samples.iter().filter_map(|s| s.fraction).collect()).unwrap_or(default);
    let fleet_tokens = mean(samples.iter().filter_map(|s| s.tokens).collect());
    let mean_capacity = mean(samples.iter().filter_map(|s| s.capacity).collect());
    for (v, s) in views.iter_mut().zip(&samples) {
        v.kv_per_request = match (s.fraction, s.capacity, fleet_tokens, mean_capacity) {
            (Some(f), ..) => f,
            (None, Some(c), Some(t), _) => (t / c).clamp(1e-4, 1.0),
            (None, Some(c), None, Some(m)) => (fleet_fraction * m / c).clamp(1e-4, 1.0),
            _ => fleet_fraction,
        };
    }
}
