//! The faults the runner switches on, one per row, with their names and what each row expects of
//! rankgate.

use crate::fleet::*;

/// The faults, in table order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Baseline,
    Kill,
    HangRequests,
    Stall,
    Fail503One,
    Health503,
    HangMetrics,
    HangModels,
    Fail503All,
}

pub const ALL: [Fault; 9] = [
    Fault::Baseline,
    Fault::Kill,
    Fault::HangRequests,
    Fault::Stall,
    Fault::Fail503One,
    Fault::Health503,
    Fault::HangMetrics,
    Fault::HangModels,
    Fault::Fail503All,
];

impl Fault {
    pub fn name(self) -> &'static str {
        match self {
            Fault::Baseline => "baseline",
            Fault::Kill => "kill",
            Fault::HangRequests => "hang-requests",
            Fault::Stall => "stall",
            Fault::Fail503One => "503-one",
            Fault::Health503 => "health-503",
            Fault::HangMetrics => "hang-metrics",
            Fault::HangModels => "hang-models",
            Fault::Fail503All => "503-all",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Fault::Baseline => "no fault",
            Fault::Kill => "engine 0 killed under streaming load, restarted 3 s later",
            Fault::HangRequests => "engine 0 hangs every request for 3 s",
            Fault::Stall => "engine 0's streams stall after 8 tokens for 3 s",
            Fault::Fail503One => "engine 0 answers 503 to everything for 3 s",
            Fault::Health503 => "engine 0's /health answers 503 for 3 s, metrics healthy",
            Fault::HangMetrics => "engine 0's /metrics hangs for 3 s",
            Fault::HangModels => "engine 0's /v1/models hangs from its start until 4.5 s",
            Fault::Fail503All => "every engine answers 503 to everything for 3 s",
        }
    }

    /// Engines the fault hits; their ranks are the ones timed in the eject/recover columns.
    pub fn affected(self) -> Vec<usize> {
        match self {
            Fault::Baseline => Vec::new(),
            Fault::Fail503All => (0..ENGINES).collect(),
            _ => vec![0],
        }
    }
}
