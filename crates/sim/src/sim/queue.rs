//! How the simulated engine's ranks take their waiting requests, as vLLM's scheduler does:
//! `--max-num-seqs`, `--scheduling-policy` and the `priority` a request carries. The queue itself
//! is the rank's ([`super::rank::Queueing`]).
//!
//! vLLM v1's scheduler walks its waiting queue in order each step and stops at the first request
//! it cannot schedule, for want of free KV blocks or because `max_num_seqs` requests already run:
//! the requests behind it wait too, however small (head-of-line blocking). Under FCFS, the
//! default, the order is arrival; under `priority` it is the request's `priority` (lower first),
//! then arrival. A `priority` other than 0 under FCFS is refused with a 400, as vLLM refuses it.
//!
//! vLLM preempts only when a running request cannot get a KV block for its next token (under
//! `priority` the worst-priority running request gives way, under FCFS the last started). The
//! sim reserves a request's whole output when it starts, so no running request ever needs a
//! block more and none is preempted: a better-priority request goes to the head of the queue
//! and waits there for KV like any other.
//!
//! The SGLang flavor keeps the sim's looser queue (any waiting request that fits starts) and has
//! no priority; `max_num_seqs` caps its running requests all the same, as SGLang's
//! `--max-running-requests` does.

use serde_json::Value;

use super::rank::Queueing;
use super::routes::Api;
use super::{Sim, SimConfig, SimFlavor};

/// vLLM's `--scheduling-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SchedulingPolicy {
    /// First come, first served.
    #[default]
    Fcfs,
    /// By the request's `priority`, lower first, then by arrival.
    Priority,
}

impl SimConfig {
    /// How each rank's queue runs.
    pub(crate) fn queueing(&self) -> Queueing {
        Queueing {
            max_running: self.max_num_seqs.max(1),
            in_order: self.flavor == SimFlavor::Vllm,
        }
    }

    /// What is wrong with the queue settings, if anything.
    pub fn check_queue(&self) -> Result<(), String> {
        if self.max_num_seqs == 0 {
            return Err("max_num_seqs must be at least 1".into());
        }
        if self.scheduling_policy == SchedulingPolicy::Priority && self.flavor != SimFlavor::Vllm {
            return Err("scheduling_policy priority is vLLM's; the SGLang flavor has none".into());
        }
        Ok(())
    }
}

impl Sim {
    /// The place a generation request asks for in its rank's queue: its body's `priority` (vLLM
    /// chat and completions), 0 when absent; `Err` with the reason for a 400 when it is not an
    /// integer, or is not 0 while the engine schedules FCFS.
    pub(super) fn priority(&self, api: Api, body: &Value) -> Result<i64, String> {
        if self.cfg.flavor != SimFlavor::Vllm || !matches!(api, Api::Chat | Api::Completion) {
            return Ok(0);
        }
        let p = match body.get("priority") {
            None => return Ok(0),
            Some(v) => v
                .as_i64()
                .ok_or_else(|| format!("priority must be an integer, got {v}"))?,
        };
        if p != 0 && self.cfg.scheduling_policy == SchedulingPolicy::Fcfs {
            return Err(format!(
                "priority {p} needs priority scheduling; this engine schedules fcfs"
            ));
        }
        Ok(p)
    }
}
