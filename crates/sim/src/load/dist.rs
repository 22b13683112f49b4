//! Token-count distributions for generated workloads, written `200`, `uniform:100:300`,
//! `normal:200:50` or `exp:200`, and JSONL traces of recorded requests.

use std::time::Duration;

use rand::Rng;
use serde::Deserialize;

/// A distribution of token counts; samples are at least 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Dist {
    Fixed(u64),
    Uniform(u64, u64),
    Normal { mean: f64, sd: f64 },
    Exp { mean: f64 },
}

impl std::str::FromStr for Dist {
    type Err = String;

    fn from_str(s: &str) -> Result<Dist, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let num = |i: usize| -> Result<f64, String> {
            let p = parts
                .get(i)
                .ok_or_else(|| format!("{s:?}: missing parameter {i}"))?;
            let v: f64 = p
                .parse()
                .map_err(|_| format!("{s:?}: {p:?} is not a number"))?;
            if v.is_finite() && v >= 0.0 {
                Ok(v)
            } else {
                Err(format!("{s:?}: {p:?} must be a finite number >= 0"))
            }
        };
        let d = match parts[0] {
            "uniform" if parts.len() == 3 => {
                let (a, b) = (num(1)? as u64, num(2)? as u64);
                if a > b {
                    return Err(format!("{s:?}: min is above max"));
                }
                Dist::Uniform(a, b)
            }
            "normal" if parts.len() == 3 => Dist::Normal {
                mean: num(1)?,
                sd: num(2)?,
            },
            "exp" if parts.len() == 2 => Dist::Exp { mean: num(1)? },
            _ if parts.len() == 1 => Dist::Fixed(num(0)? as u64),
            _ => {
                return Err(format!(
                    "{s:?}: use N, uniform:MIN:MAX, normal:MEAN:SD or exp:MEAN"
                ))
            }
        };
        Ok(d)
    }
}

impl<'de> Deserialize<'de> for Dist {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(Dist::Fixed(n)),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl Dist {
    pub fn sample(&self, rng: &mut impl Rng) -> u64 {
        let x = match *self {
            Dist::Fixed(n) => n as f64,
            Dist::Uniform(a, b) => rng.random_range(a..=b) as f64,
            Dist::Normal { mean, sd } => {
                // Box-Muller: two uniforms make one standard normal.
                let u1: f64 = rng.random_range(f64::EPSILON..1.0);
                let u2: f64 = rng.random();
                mean + sd * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
            }
            Dist::Exp { mean } => -mean * rng.random_range(f64::EPSILON..1.0f64).ln(),
        };
        x.round().max(1.0) as u64
    }
}

/// One recorded request of a JSONL trace: `{"prompt_tokens": N, "output_tokens": M, "at_ms": T}`
/// (`at_ms` optional: without it, arrivals follow the configured rate), optionally with
/// `"prefix_id": I, "prefix_tokens": P`: every entry naming prefix I starts with the same P
/// tokens, followed by its own `prompt_tokens`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceEntry {
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub at_ms: Option<u64>,
    pub prefix_id: Option<u64>,
    pub prefix_tokens: Option<u64>,
}

impl TraceEntry {
    pub fn at(&self) -> Option<Duration> {
        self.at_ms.map(Duration::from_millis)
    }
}

/// Reads a JSONL trace; errors name the line.
pub fn read_trace(text: &str) -> Result<Vec<TraceEntry>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let e: TraceEntry =
                serde_json::from_str(l).map_err(|e| format!("trace line {}: {e}", i + 1))?;
            if e.prefix_id.is_some() != e.prefix_tokens.is_some() {
                return Err(format!(
                    "trace line {}: prefix_id and prefix_tokens go together",
                    i + 1
                ));
            }
            Ok(e)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_every_form() {
        assert_eq!("200".parse(), Ok(Dist::Fixed(200)));
        assert_eq!("uniform:10:20".parse(), Ok(Dist::Uniform(10, 20)));
        assert_eq!(
            "normal:200:50".parse(),
            Ok(Dist::Normal {
                mean: 200.0,
                sd: 50.0
            })
        );
        assert_eq!("exp:64".parse(), Ok(Dist::Exp { mean: 64.0 }));
        for bad in [
            "",
            "uniform:5",
            "uniform:9:1",
            "normal:x:1",
            "gamma:1:2",
            "-3",
            "NaN",
        ] {
            assert!(bad.parse::<Dist>().is_err(), "{bad}");
        }
    }

    #[test]
    fn trace_lines() {
        let t = read_trace("{\"prompt_tokens\":10,\"output_tokens\":5}\n\n{\"prompt_tokens\":1,\"output_tokens\":2,\"at_ms\":30}\n").unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[1].at(), Some(Duration::from_millis(30)));
        let e =
            read_trace("{\"prompt_tokens\":1,\"output_tokens\":1}\n{\"prompt\":1}\n").unwrap_err();
        assert!(e.starts_with("trace line 2"), "{e}");
        let t = read_trace(
            "{\"prompt_tokens\":1,\"output_tokens\":1,\"prefix_id\":3,\"prefix_tokens\":900}\n",
        )
        .unwrap();
        assert_eq!((t[0].prefix_id, t[0].prefix_tokens), (Some(3), Some(900)));
        let e =
            read_trace("{\"prompt_tokens\":1,\"output_tokens\":1,\"prefix_id\":3}\n").unwrap_err();
        assert!(e.contains("line 1") && e.contains("go together"), "{e}");
    }

    proptest! {
        #[test]
        fn samples_stay_in_range(a in 0u64..1000, w in 0u64..1000, seed in any::<u64>()) {
            use rand::SeedableRng;
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
            let d = Dist::Uniform(a, a + w);
            for _ in 0..20 {
                let x = d.sample(&mut rng);
                prop_assert!(x >= a.max(1) && x <= (a + w).max(1));
            }
            let wide = Dist::Normal { mean: 5.0, sd: 100.0 };
            prop_assert!(wide.sample(&mut rng) >= 1);
        }
    }
}
