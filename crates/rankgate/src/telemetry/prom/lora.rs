//! `vllm:lora_requests_info`, vLLM's LoRA gauge: a series per label set ever seen (`max_lora`,
//! `running_lora_adapters`, `waiting_lora_adapters`, the adapters comma-separated), each valued
//! at the time it was last set, so the series with the newest value is the engine's state now.
//! It has no `engine` label: with data parallelism it mixes the ranks' adapters, so what runs
//! where is read from it only for a server of one rank (`crate::adapters`); `max_lora` is every
//! engine core's own setting, so it holds for each rank.

use std::sync::Arc;

/// Adapters a sample may name at most, and the longest label value read: a gauge past these is
/// not vLLM's and is ignored, not stored.
const MAX_NAMES: usize = 64;
const MAX_LABEL_BYTES: usize = 16 * 1024;

/// The gauge's newest series.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoraGauge {
    /// When it was set (the sample's value, seconds since the epoch).
    pub at: f64,
    /// `--max-loras`: adapters one engine core's batch runs at once.
    pub max_lora: Option<u32>,
    /// The adapters running now.
    pub running: Vec<Arc<str>>,
}

impl LoraGauge {
    /// Tells the engine's ranks (`members`) what `gauge` says: `max_lora` and what runs on the
    /// server to each, what runs counted as the rank's own only where the server has one rank. A scrape without
    /// the gauge (an engine restarted without adapters) says nothing, and takes back what the
    /// last one said.
    pub fn tell(gauge: Option<&LoraGauge>, members: &[Arc<crate::worker::Member>]) {
        let one = members.len() == 1;
        for m in members {
            match gauge {
                Some(g) => m.adapters.engine_said(g.max_lora, &g.running, one),
                None => m.adapters.engine_said(None, &[], false),
            }
        }
    }

    /// Keeps the sample with `labels` and `value` when it is newer than `kept`; `false` when it
    /// cannot be read.
    pub fn keep_newest(
        kept: &mut Option<LoraGauge>,
        labels: &[(&str, std::borrow::Cow<'_, str>)],
        value: f64,
    ) -> bool {
        let label = |k: &str| labels.iter().find(|(n, _)| *n == k).map(|(_, v)| &**v);
        let (Some(max), Some(running)) = (label("max_lora"), label("running_lora_adapters")) else {
            return false;
        };
        if !value.is_finite() || running.len() > MAX_LABEL_BYTES {
            return false;
        }
        if kept.as_ref().is_some_and(|k| k.at >= value) {
            return true;
        }
        let names: Vec<Arc<str>> = (running.split(','))
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .take(MAX_NAMES + 1)
            .map(Arc::from)
            .collect();
        if names.len() > MAX_NAMES {
            return false;
        }
        *kept = Some(LoraGauge {
            at: value,
            max_lora: max.parse().ok().filter(|&m| m >= 1),
            running: names,
        });
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse;

    #[test]
    fn the_newest_series_is_the_state_now() {
        let text =
            include_str!("../../../../../tests/fixtures/vllm-0.32-lora/metrics-lora-competing.txt");
        let g = parse(text).lora.unwrap();
        assert_eq!(g.max_lora, Some(1));
        assert_eq!(
            g.running,
            vec!["sql-lora".into()] as Vec<std::sync::Arc<str>>
        );
        let two = "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a,b\",waiting_lora_adapters=\"\"} 20\nvllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 10\n";
        let g = parse(two).lora.unwrap();
        assert_eq!((g.max_lora, g.running.len()), (Some(2), 2));
        // Unreadable samples are counted and change nothing.
        let bad = "vllm:lora_requests_info{running_lora_adapters=\"a\"} 5\n";
        let s = parse(bad);
        assert_eq!((s.lora, s.bad_lines), (None, 1));
        let many: Vec<String> = (0..65).map(|i| format!("a{i}")).collect();
        let flood = format!(
            "vllm:lora_requests_info{{max_lora=\"1\",running_lora_adapters=\"{}\"}} 5\n",
            many.join(",")
        );
        assert_eq!(parse(&flood).lora, None);
    }
}
