//! The wire shape of load reports (gRPC `GetLoads`, SGLang `/v1/loads`, a gateway's `/loads`)
//! and the lenient JSON reader for it.
//!
//! A leaf module: the snapshot ([`crate::table`]) keeps a gateway's entries as they came, and the
//! projection ([`crate::telemetry::loads`]) reads them, so both import these types from here and
//! the snapshot never imports telemetry.

use serde::Serialize;
use serde_json::Value;

/// One entry of a load report. Every field is optional because JSON reports may omit any of
/// them; gRPC entries always carry all (proto3 defaults).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RankLoad {
    pub dp_rank: Option<i64>,
    pub num_running_reqs: Option<i64>,
    pub num_waiting_reqs: Option<i64>,
    pub num_used_tokens: Option<i64>,
    pub max_total_num_tokens: Option<i64>,
    pub token_usage: Option<f64>,
    pub gen_throughput: Option<f64>,
    pub utilization: Option<f64>,
    /// Fleet-rollup annotation: the worker this entry describes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_type: Option<String>,
    /// A field of the wrong JSON type, recorded so the entry is rejected with a reason.
    #[serde(skip)]
    pub malformed: Option<String>,
}

/// A rollup's engine-wide figures (SGLang and gateways).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Aggregate {
    pub total_running_reqs: Option<i64>,
    pub total_waiting_reqs: Option<i64>,
    pub avg_token_usage: Option<f64>,
}

/// A whole load report.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadsReport {
    pub dp_rank_count: Option<i64>,
    pub loads: Vec<RankLoad>,
    pub aggregate: Option<Aggregate>,
}

fn int(v: &Value, key: &str, malformed: &mut Option<String>) -> Option<i64> {
    match v.get(key) {
        None | Some(Value::Null) => None,
        Some(x) => match x
            .as_i64()
            .or_else(|| x.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
        {
            Some(n) => Some(n),
            None => {
                *malformed = Some(format!("{key} is not an integer: {x}"));
                None
            }
        },
    }
}

fn float(v: &Value, key: &str, malformed: &mut Option<String>) -> Option<f64> {
    match v.get(key) {
        None | Some(Value::Null) => None,
        Some(x) => match x.as_f64() {
            Some(f) => Some(f),
            None => {
                *malformed = Some(format!("{key} is not a number: {x}"));
                None
            }
        },
    }
}

impl RankLoad {
    fn from_json(v: &Value) -> RankLoad {
        let mut m = None;
        if !v.is_object() {
            m = Some(format!("entry is not an object: {v}"));
        }
        RankLoad {
            dp_rank: int(v, "dp_rank", &mut m),
            num_running_reqs: int(v, "num_running_reqs", &mut m),
            num_waiting_reqs: int(v, "num_waiting_reqs", &mut m),
            num_used_tokens: int(v, "num_used_tokens", &mut m),
            max_total_num_tokens: int(v, "max_total_num_tokens", &mut m),
            token_usage: float(v, "token_usage", &mut m),
            gen_throughput: float(v, "gen_throughput", &mut m),
            utilization: float(v, "utilization", &mut m),
            worker: v.get("worker").and_then(Value::as_str).map(str::to_string),
            worker_type: v
                .get("worker_type")
                .and_then(Value::as_str)
                .map(str::to_string),
            malformed: m,
        }
    }

    /// Checks one entry; returns why it is unusable.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(m) = &self.malformed {
            return Err(m.clone());
        }
        for (name, v) in [
            ("token_usage", self.token_usage),
            ("gen_throughput", self.gen_throughput),
            ("utilization", self.utilization),
        ] {
            if let Some(x) = v {
                if !x.is_finite() {
                    return Err(format!("{name} is {x}"));
                }
            }
        }
        match self.token_usage {
            None => return Err("no token_usage".into()),
            Some(u) if !(0.0..=1.0).contains(&u) => {
                return Err(format!("token_usage {u} outside [0, 1]"))
            }
            _ => {}
        }
        for (name, v) in [
            ("num_running_reqs", self.num_running_reqs),
            ("num_waiting_reqs", self.num_waiting_reqs),
            ("num_used_tokens", self.num_used_tokens),
            ("max_total_num_tokens", self.max_total_num_tokens),
        ] {
            if let Some(n) = v {
                if n < 0 {
                    return Err(format!("negative {name} {n}"));
                }
            }
        }
        Ok(())
    }
}

impl LoadsReport {
    /// Reads a JSON report leniently: a malformed entry is kept (and later rejected on its own),
    /// so one bad entry does not void the others.
    pub fn from_json(body: &[u8]) -> Result<LoadsReport, String> {
        let v: Value = serde_json::from_slice(body).map_err(|e| format!("invalid JSON: {e}"))?;
        let loads = match v.get("loads") {
            Some(Value::Array(a)) => a.iter().map(RankLoad::from_json).collect(),
            Some(other) => return Err(format!("`loads` is not an array: {other}")),
            None => return Err("no `loads` array".into()),
        };
        let aggregate = v.get("aggregate").filter(|a| a.is_object()).map(|a| {
            let mut m = None;
            Aggregate {
                total_running_reqs: int(a, "total_running_reqs", &mut m),
                total_waiting_reqs: int(a, "total_waiting_reqs", &mut m),
                avg_token_usage: float(a, "avg_token_usage", &mut m),
            }
        });
        Ok(LoadsReport {
            dp_rank_count: v.get("dp_rank_count").and_then(Value::as_i64),
            loads,
            aggregate,
        })
    }

    /// Entries carrying `worker` annotations make the report a gateway's fleet rollup.
    pub fn is_rollup(&self) -> bool {
        self.loads.iter().any(|l| l.worker.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_reports_are_read_leniently() {
        let body = br#"{"dp_rank_count":2,"loads":[{"dp_rank":0,"token_usage":"lots"},{"dp_rank":1,"token_usage":0.25}]}"#;
        let r = LoadsReport::from_json(body).unwrap();
        assert_eq!(r.dp_rank_count, Some(2));
        assert!(r.loads[0].validate().is_err());
        assert!(r.loads[1].validate().is_ok());
        assert!(!r.is_rollup());
        assert!(LoadsReport::from_json(b"{}").is_err());
        assert!(LoadsReport::from_json(b"not json").is_err());
    }
}
