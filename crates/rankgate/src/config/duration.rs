//! Durations as written in the config (`250ms`, `2s`, `1m`), and the ranges they must fall in.

use std::time::Duration;

use serde::{Deserialize, Deserializer};

use super::error::{invalid, ConfigError};

/// A duration written the human way: `250ms`, `2s`, `1.5s`, `1m`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HumanDuration(pub Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = HumanDuration;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a duration with its unit, such as \"250ms\", \"2s\" or \"1m\"")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<HumanDuration, E> {
                parse_duration(s).map(HumanDuration).map_err(E::custom)
            }
            // A bare number is the commonest slip: say what to write instead.
            // The number itself is not repeated: errors never echo the file (see
            // `whole::describe_toml_error`), and the line and column point at it.
            fn visit_i64<E: serde::de::Error>(self, _n: i64) -> Result<HumanDuration, E> {
                Err(E::custom(
                    "a number has no unit: write it as a string with one, e.g. \"250ms\" or \"2s\"",
                ))
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<HumanDuration, E> {
                self.visit_i64(n.min(i64::MAX as u64) as i64)
            }
            fn visit_f64<E: serde::de::Error>(self, _n: f64) -> Result<HumanDuration, E> {
                Err(E::custom(
                    "a number has no unit: write it as a string with one, e.g. \"1.5s\"",
                ))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// Parses `<number><unit>` with unit `ms`, `s` or `m`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("duration {s:?} has no unit (use ms, s or m)"))?;
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(format!(
            "duration {s:?} must be a number followed by ms, s or m"
        ));
    }
    let n: f64 = num
        .parse()
        .map_err(|_| format!("duration {s:?}: {num:?} is not a number"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        _ => {
            return Err(format!(
                "duration {s:?}: unknown unit {unit:?} (use ms, s or m)"
            ))
        }
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("duration {s:?}: {e}"))
}

/// A duration from the config, its default, and the range it must fall in.
pub(super) fn duration(
    key: &str,
    v: Option<HumanDuration>,
    default: Duration,
    min: Duration,
    max: Duration,
) -> Result<Duration, ConfigError> {
    let d = v.map_or(default, |d| d.0);
    if d < min || d > max {
        return Err(invalid(
            key,
            format!("{d:?} is outside the sane range [{min:?}, {max:?}]"),
        ));
    }
    Ok(d)
}

pub(super) const fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

pub(super) const fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}
