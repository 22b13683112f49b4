//! One rank's compute, shared by its prefills and its decode steps, when
//! [`super::SimConfig::prefill_interference`] is on: the effect prefill/decode disaggregation
//! exists to remove.
//!
//! A GPU runs one forward pass at a time. A long prompt's prefill takes the rank's steps for as
//! long as it runs, so the tokens of every request decoding on that rank wait for it (vLLM
//! without chunked prefill schedules waiting prefills first; with chunked prefill the same work
//! is spread over several steps, each one slower). The model here is the simplest one with that
//! shape: one fair (FIFO) gate per rank; a prefill holds it for its whole time, so prefills run
//! one after the other, and a decode step passes through it, so a token waits for the prefill
//! running ahead of it. A decode server's ranks (whose prompts' KV came from a prefill server)
//! and prompts found whole in the prefix cache prefill nothing and take no turn.
//!
//! Off (the default), prefills run side by side and never slow a decode, as every scenario and
//! test before this knob measured.

use tokio::sync::Mutex;

use super::Sim;

/// Per local rank, the gate its prefills and decode steps take turns through.
#[derive(Debug, Default)]
pub(crate) struct Compute {
    gates: Vec<Mutex<()>>,
}

impl Compute {
    pub(crate) fn new(ranks: u32) -> Compute {
        Compute {
            gates: (0..ranks).map(|_| Mutex::new(())).collect(),
        }
    }
}

impl Sim {
    /// Prefills `tokens` of prompt on local rank `local`: after the prefills queued ahead of it
    /// with interference on, side by side with them without.
    pub(crate) async fn prefill(&self, local: usize, tokens: u64) {
        let gate = (self.cfg.prefill_interference && tokens > 0)
            .then(|| self.compute.gates.get(local))
            .flatten();
        let _turn = match gate {
            Some(g) => Some(g.lock().await),
            None => None,
        };
        super::pause(self.prefill_time(tokens)).await;
    }

    /// A decode step on local rank `local`: with interference on, it waits for the prefill that
    /// holds the rank's compute (and those queued before the step), then lets the next one run.
    pub(crate) async fn decode_step(&self, local: usize) {
        if !self.cfg.prefill_interference {
            return;
        }
        if let Some(g) = self.compute.gates.get(local) {
            drop(g.lock().await);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::sim::{SimConfig, SimEngine};

    async fn engine(interference: bool) -> SimEngine {
        let cfg = SimConfig {
            dp_size: 1,
            prefill_tokens_per_sec: 1000.0,
            prefill_interference: interference,
            ..SimConfig::default()
        };
        SimEngine::start(([127, 0, 0, 1], 0).into(), cfg)
            .await
            .unwrap()
    }

    /// Two prefills of 100 ms each: one after the other with interference, side by side without;
    /// a decode step waits for the prefill holding the rank.
    #[tokio::test(start_paused = true)]
    async fn prefills_take_turns_and_hold_decode_steps() {
        for (on, want) in [(true, 200), (false, 100)] {
            let e = engine(on).await;
            let sim = e.sim.clone();
            let start = tokio::time::Instant::now();
            let (a, b) = (sim.clone(), sim.clone());
            let first = tokio::spawn(async move { a.prefill(0, 100).await });
            tokio::task::yield_now().await;
            let step = tokio::spawn(async move {
                b.decode_step(0).await;
                tokio::time::Instant::now()
            });
            tokio::task::yield_now().await;
            sim.prefill(0, 100).await;
            first.await.unwrap();
            let stepped = step.await.unwrap() - start;
            assert_eq!(
                start.elapsed(),
                Duration::from_millis(want),
                "interference {on}"
            );
            let step_want = if on { 100 } else { 0 };
            assert_eq!(
                stepped,
                Duration::from_millis(step_want),
                "interference {on}"
            );
            // A prompt whose KV came from elsewhere prefills nothing and takes no turn.
            let t = tokio::time::Instant::now();
            sim.prefill(0, 0).await;
            assert_eq!(t.elapsed(), Duration::ZERO);
            e.shutdown().await;
        }
    }
}
