//! The load client spreading requests over adapters (each served as a model), and a scenario
//! of engines with adapters behind rankgate, its report counting the slot waits.

use std::time::Duration;

use rankgate_sim::load::{self, Arrivals, Dist, ModelSpread, Workload};
use rankgate_sim::scenario::{self, Scenario};

use crate::common::engine;
use crate::lora_engine;

#[tokio::test]
async fn the_load_client_spreads_requests_over_models_evenly_or_at_random() {
    let adapters = ["a", "b", "c"];
    for (spread, exact) in [(ModelSpread::Even, true), (ModelSpread::Random, false)] {
        let e = engine(lora_engine(2, 1, &adapters, false)).await;
        let mut w = Workload::new(e.url());
        w.arrivals = Arrivals::Closed(3);
        w.requests = 30;
        w.output_tokens = Dist::Fixed(2);
        w.duration = Duration::from_secs(30);
        w.models = adapters.iter().map(|a| a.to_string()).collect();
        w.model_spread = spread;
        let r = load::run(&w).await.unwrap();
        assert_eq!(r.ok().count(), 30, "{spread:?}");
        let seen = e.seen();
        let count = |m: &str| {
            seen.iter()
                .filter(|s| s.model.as_deref() == Some(m))
                .count()
        };
        let counts: Vec<usize> = adapters.iter().map(|a| count(a)).collect();
        assert_eq!(counts.iter().sum::<usize>(), 30, "{spread:?}: {counts:?}");
        if exact {
            assert_eq!(counts, [10, 10, 10]);
        } else {
            assert!(counts.iter().all(|&n| n > 0), "{counts:?}");
        }
        e.shutdown().await;
    }
}

const ADAPTERS: &str = r#"
name = "adapters"
policies = ["least_kv"]
[router]
interval = "50ms"
[[engines]]
flavor = "vllm"
dp_size = 2
decode_rate = 400
lora_modules = ["a=org/a", "b=org/b", "c=org/c", "d=org/d"]
max_loras = 1
lora_load = "2ms"
[workload]
rate = 60
requests = 32
duration = "20s"
prompt_tokens = 50
output_tokens = 4
models = ["a", "b", "c", "d"]
"#;

#[tokio::test]
async fn a_scenario_of_adapters_behind_rankgate_reports_slot_waits() {
    let s = Scenario::parse(ADAPTERS, None).unwrap();
    let runs = scenario::run(&s, None, false).await.unwrap();
    let r = &runs[0];
    assert_eq!(
        r.report.ok().count(),
        32,
        "every adapter is routed and served"
    );
    let loads: u64 = r.ranks.iter().map(|x| x.lora_loads).sum();
    assert!(loads >= 4, "each adapter loaded at least once: {loads}");
    let md = scenario::render::markdown(&s, &runs);
    assert!(
        md.contains("| policy | LoRA slot waits | slot loads |"),
        "{md}"
    );
    let json = scenario::render::to_json(&s, &runs);
    assert!(json["policies"][0]["ranks"][0]["lora_slot_waits"].is_u64());
}
