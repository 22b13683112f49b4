#!/usr/bin/env bash
# Gray failures at the acceptance's size: a simulated engine whose requests hang (its /health
# and /metrics answer) beside a healthy one, 100 requests over 20 s (one every 200 ms), clients
# giving up after 2 s. Runs the integration test `hung_rank_beside_a_healthy_one_is_ejected_and_shown`
# (tests/faults/engines/hung.rs; CI runs it with 40 requests) at full size, RUNS times, and
# prints its figures: how many requests reached the hung rank, and how many after the first 5 s
# (the acceptance: at most 3). docs/reliability.md "Gray failures" quotes a run.
# Usage: RUNS=3 bench/gray-failure.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
for run in $(seq "$RUNS"); do
  RANKGATE_GRAY_FULL=1 cargo test -q --workspace --features kubernetes,otlp --test faults \
    -- hung_rank_beside_a_healthy_one --nocapture 2>&1 | grep -E '^gray failure:|FAILED|panicked' \
    | sed "s/^/run $run: /"
done
