//! What a scenario compares: router variants (a policy, optionally with prefix affinity on), each
//! run with one or several rankgate replicas side by side.
//!
//! A variant is written as its policy's name, `+affinity` appended for `prefix_affinity = true`
//! in `[routing]` (rankgate's record of what it sent where), `+kv_events` for affinity that
//! follows the engines' own KV-cache events (`kv_events = true` too): `"least_kv"`,
//! `"least_kv+affinity"`, `"least_kv+kv_events"`, `"round_robin"`; `+flow` last for flow control
//! (the scenario's `[flow]` table given to the router as its `[flow]` section):
//! `"least_kv+flow"`, `"least_kv+affinity+flow"`; `+adapters` (before `+flow`) for adapter
//! affinity, which every other variant runs without. The scenario file's `policies = [...]` and
//! `rankgate load --policies` read the same strings.

use std::fmt::Write as _;

use serde::Deserialize;

use rankgate::config::Policy;

/// A router configuration a scenario runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    pub policy: Policy,
    pub affinity: Affinity,
    /// Flow control on: the scenario's `[flow]` table becomes the router's `[flow]` section.
    pub flow: bool,
    /// `routing.adapter_affinity` on (off otherwise, so a variant names what it weighs).
    pub adapters: bool,
}

/// Whether and how picks weigh where a prompt's prefix is cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Affinity {
    Off,
    /// `prefix_affinity = true`: rankgate's record of the prefixes it sent to each rank.
    Guess,
    /// `kv_events = true` as well: the blocks each rank's engine says it holds.
    Events,
}

impl From<Policy> for Variant {
    fn from(policy: Policy) -> Variant {
        Variant {
            policy,
            affinity: Affinity::Off,
            flow: false,
            adapters: false,
        }
    }
}

impl Variant {
    /// Its name as written in scenario files.
    pub fn as_str(&self) -> String {
        let mut name = self.policy.as_str().to_string();
        name.push_str(match self.affinity {
            Affinity::Off => "",
            Affinity::Guess => "+affinity",
            Affinity::Events => "+kv_events",
        });
        if self.adapters {
            name.push_str("+adapters");
        }
        if self.flow {
            name.push_str("+flow");
        }
        name
    }

    /// The `[routing]` section of the router's configuration.
    pub fn routing_toml(&self) -> String {
        let mut t = format!("[routing]\npolicy = \"{}\"\n", self.policy.as_str());
        // Written only when on, so a router without the key still reads the other variants.
        if self.affinity != Affinity::Off {
            t.push_str("prefix_affinity = true\n");
        }
        if self.affinity == Affinity::Events {
            t.push_str("kv_events = true\n");
        }
        let _ = writeln!(t, "adapter_affinity = {}", self.adapters);
        t
    }

    /// Whether the engines must publish their KV-cache events for it.
    pub fn kv_events(&self) -> bool {
        self.affinity == Affinity::Events
    }
}

impl std::str::FromStr for Variant {
    type Err = String;

    fn from_str(s: &str) -> Result<Variant, String> {
        let mut parts = s.trim().split('+');
        let name = parts.next().unwrap_or_default();
        let (mut affinity, mut flow, mut adapters) = (Affinity::Off, false, false);
        for option in parts {
            match option {
                "affinity" | "kv_events" if affinity != Affinity::Off || flow => {
                    return Err(format!(
                        "variant {s:?}: one of `+affinity` or `+kv_events`, before any `+flow`"
                    ))
                }
                "affinity" => affinity = Affinity::Guess,
                "kv_events" => affinity = Affinity::Events,
                "adapters" if adapters || flow => {
                    return Err(format!("variant {s:?}: `+adapters` once, before any `+flow`"))
                }
                "adapters" => adapters = true,
                "flow" if flow => return Err(format!("variant {s:?}: `+flow` twice")),
                "flow" => flow = true,
                other => {
                    return Err(format!(
                        "variant {s:?}: unknown option {other:?} after `+` (`+affinity`, `+kv_events`, `+adapters` or `+flow`)"
                    ))
                }
            }
        }
        let policy = match name {
            "least_kv" => Policy::LeastKv,
            "round_robin" => Policy::RoundRobin,
            "random" => Policy::Random,
            other => {
                return Err(format!(
                    "variant {s:?}: unknown policy {other:?} (least_kv, round_robin or random; least_kv optionally +affinity or +kv_events; any of them +flow)"
                ))
            }
        };
        if (affinity != Affinity::Off || adapters) && policy != Policy::LeastKv {
            return Err(format!(
                "variant {s:?}: affinity chooses among the ranks load allows, so it goes with least_kv only"
            ));
        }
        Ok(Variant {
            policy,
            affinity,
            flow,
            adapters,
        })
    }
}

impl<'de> Deserialize<'de> for Variant {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// `replicas = 3` or `replicas = [1, 3]`: how many rankgate routers run side by side, each
/// variant once per count.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Replicas {
    One(u32),
    Each(Vec<u32>),
}

impl Default for Replicas {
    fn default() -> Self {
        Replicas::One(1)
    }
}

impl Replicas {
    pub fn counts(&self) -> Vec<u32> {
        match self {
            Replicas::One(n) => vec![*n],
            Replicas::Each(v) => v.clone(),
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        let c = self.counts();
        if c.is_empty() || c.iter().any(|&n| n == 0 || n > 16) {
            return Err(format!(
                "router.replicas: each count must be within 1..=16, got {c:?}"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_round_trip_and_bad_ones_are_named() {
        for s in [
            "least_kv",
            "least_kv+affinity",
            "least_kv+kv_events",
            "round_robin",
            "random",
            "least_kv+flow",
            "least_kv+affinity+flow",
            "least_kv+kv_events+flow",
            "round_robin+flow",
            "least_kv+adapters",
            "least_kv+affinity+adapters+flow",
        ] {
            assert_eq!(s.parse::<Variant>().unwrap().as_str(), s);
        }
        let v: Variant = "least_kv+affinity".parse().unwrap();
        assert!(v.routing_toml().contains("prefix_affinity = true"));
        let plain = Variant::from(Policy::LeastKv).routing_toml();
        assert!(!plain.contains("prefix_affinity") && plain.contains("adapter_affinity = false"));
        let v: Variant = "least_kv+adapters".parse().unwrap();
        assert!(v.routing_toml().contains("adapter_affinity = true"));
        let v: Variant = "least_kv+kv_events".parse().unwrap();
        assert!(v
            .routing_toml()
            .contains("prefix_affinity = true\nkv_events = true"));
        assert!(v.kv_events());
        let v: Variant = "least_kv+kv_events+flow".parse().unwrap();
        assert!(v.flow && v.kv_events());
        assert!(!Variant::from(Policy::LeastKv).flow);
        for bad in [
            "least_kv+flow+affinity",
            "least_kv+flow+flow",
            "least_kv+affinity+kv_events",
            "least_kv+flow+adapters",
            "round_robin+adapters",
        ] {
            let e = bad.parse::<Variant>().unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
        let e = "least_kv+flw".parse::<Variant>().unwrap_err();
        assert!(e.contains("\"flw\"") && e.contains("+flow"), "{e}");
        let e = "round_robin+affinity".parse::<Variant>().unwrap_err();
        assert!(e.contains("least_kv only"), "{e}");
        let e = "least_kv+afinity".parse::<Variant>().unwrap_err();
        assert!(e.contains("afinity"), "{e}");
        let e = "leastkv".parse::<Variant>().unwrap_err();
        assert!(e.contains("unknown policy"), "{e}");
        assert!(Replicas::Each(vec![1, 0]).validate().is_err());
        assert_eq!(Replicas::default().counts(), [1]);
    }
}
