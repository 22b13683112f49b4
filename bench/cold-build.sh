#!/usr/bin/env bash
# The README's cost figures: its two set-up commands run cold (a fresh clone, an empty target/;
# the crates.io cache kept, as after a first download) in a scratch directory, RUNS times, on a
# machine that should be otherwise idle. Prints per run the demo's build and run, the tests'
# build and run, and target/'s size; the README states what these gave.
# Usage: RUNS=3 bench/cold-build.sh          (the committed HEAD, not the work tree)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
secs() { sed -nE 's/.*Finished .* in (([0-9]+)m )?([0-9.]+)s.*/\2:\3/p' "$1" | tail -1 | awk -F: '{printf "%.0f", $1 * 60 + $2}'; }
echo "| run | demo build s | demo run s | test build s | test run s | target/ (release, debug) |"
echo "|---|---|---|---|---|---|"
for run in $(seq "$RUNS"); do
  rm -rf "$scratch/repo"
  git clone -q "$PWD" "$scratch/repo"
  (
    cd "$scratch/repo"
    unset CARGO_TARGET_DIR
    t0=$(date +%s)
    cargo run --release --locked -- demo > "$scratch/demo.out" 2> "$scratch/demo.err"
    t1=$(date +%s)
    cargo test --workspace --features kubernetes,otlp --locked > "$scratch/test.out" 2> "$scratch/test.err"
    t2=$(date +%s)
    db=$(secs "$scratch/demo.err"); tb=$(secs "$scratch/test.err")
    size() { du -sh "$1" | cut -f1; }
    echo "| $run | $db | $((t1 - t0 - db)) | $tb | $((t2 - t1 - tb)) | $(size target) ($(size target/release), $(size target/debug)) |"
  )
done
