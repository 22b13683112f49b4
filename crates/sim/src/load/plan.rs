//! The plan of an open- or closed-loop run: when each request is sent, how long its prompt and
//! answer are, and whether its prompt starts with a shared prefix; and the request body built
//! from it, unique text unless a prefix is shared.

use std::time::Duration;

use bytes::Bytes;
use rand::{Rng, SeedableRng};

use super::{text, Api, Arrivals, Workload};

/// One planned request.
#[derive(Debug, Clone, Copy)]
pub(super) struct Planned {
    pub(super) at: Option<Duration>,
    pub(super) prompt: u64,
    pub(super) output: u64,
    /// A shared prefix (id, tokens) before the request's own prompt.
    pub(super) shared: Option<(u64, u64)>,
    /// Seeds the request's own text.
    pub(super) salt: u64,
    /// Its place in the sending order, which picks its model ([`Workload::model_of`]).
    pub(super) n: usize,
}

pub(super) fn plan(w: &Workload) -> Vec<Planned> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(w.seed);
    let mut out: Vec<Planned> = Vec::new();
    let mut t = Duration::ZERO;
    let mut next_at = |rng: &mut rand::rngs::SmallRng| match w.arrivals {
        Arrivals::Poisson(rate) if rate > 0.0 => {
            // Exponential gaps make the arrivals Poisson.
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            t += Duration::from_secs_f64(-u.ln() / rate);
            Some(t)
        }
        _ => None,
    };
    let base = w
        .requests
        .saturating_sub(w.bursts.iter().map(|b| b.requests).sum());
    match &w.trace {
        Some(trace) => {
            for e in trace.iter().take(w.requests) {
                let at = e.at().or_else(|| next_at(&mut rng));
                out.push(Planned {
                    at,
                    prompt: e.prompt_tokens,
                    output: e.output_tokens,
                    shared: e.prefix_id.zip(e.prefix_tokens),
                    salt: 0,
                    n: 0,
                });
            }
        }
        None => {
            for _ in 0..base {
                let at = next_at(&mut rng);
                let prompt = w.prompt_tokens.sample(&mut rng);
                let output = w.output_tokens.sample(&mut rng);
                // Drawn only with a hot prefix, so other workloads keep their arrivals.
                let shared = w
                    .hot_prefix
                    .filter(|h| rng.random::<f64>() < h.share)
                    .map(|h| (HOT_PREFIX_ID, h.tokens));
                out.push(Planned {
                    at,
                    prompt,
                    output,
                    shared,
                    salt: 0,
                    n: 0,
                });
            }
        }
    }
    if matches!(w.arrivals, Arrivals::Poisson(_)) {
        for b in &w.bursts {
            out.extend((0..b.requests).map(|_| Planned {
                at: Some(b.at),
                prompt: b.prompt_tokens,
                output: b.output_tokens,
                shared: None,
                salt: 0,
                n: 0,
            }));
        }
    }
    for (i, p) in out.iter_mut().enumerate() {
        p.salt = text::mix(w.seed, i as u64);
    }
    out.retain(|p| p.at.is_none_or(|at| at < w.duration));
    out.sort_by_key(|p| p.at);
    for (i, p) in out.iter_mut().enumerate() {
        p.n = i;
    }
    out
}

/// The prefix id of a workload's hot prefix (trace ids are the trace's own).
const HOT_PREFIX_ID: u64 = u64::MAX;

pub(super) fn body(w: &Workload, p: &Planned) -> Bytes {
    // About four characters per token, the simulated engine's (and English text's) ratio; the
    // request's own text is unique, so it shares a prefix with others only through `shared`.
    let own = text::words(p.salt, p.prompt);
    let prompt = match p.shared {
        Some((id, tokens)) => text::shared_prefix(w.seed, id, tokens) + &own,
        None => own,
    };
    let v = match w.api {
        Api::Chat => serde_json::json!({
            "model": w.model_of(p.n), "messages": [{"role": "user", "content": prompt}],
            "max_tokens": p.output, "stream": w.stream,
        }),
        Api::Completions => serde_json::json!({
            "model": w.model_of(p.n), "prompt": prompt, "max_tokens": p.output, "stream": w.stream,
        }),
    };
    Bytes::from(v.to_string())
}

#[cfg(test)]
mod tests {
    use super::super::Burst;
    use super::*;

    #[test]
    fn plan_is_bounded_and_sorted() {
        let mut w = Workload::new("http://x");
        w.requests = 50;
        w.arrivals = Arrivals::Poisson(100.0);
        w.bursts = vec![Burst {
            at: Duration::from_millis(100),
            requests: 10,
            prompt_tokens: 2000,
            output_tokens: 8,
        }];
        w.duration = Duration::from_secs(10);
        let p = plan(&w);
        assert_eq!(p.len(), 50);
        assert_eq!(p.iter().filter(|x| x.prompt == 2000).count(), 10);
        assert!(p.windows(2).all(|x| x[0].at <= x[1].at));
        w.duration = Duration::from_millis(50);
        assert!(plan(&w).len() < 50, "nothing planned past the deadline");
    }
}
