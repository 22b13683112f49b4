#!/usr/bin/env bash
# The hostile-client suite: every attack of docs/reliability.md's "A stranger at the door"
# section, run against the release binary and `rankgate mock-engine` engines on loopback, each
# printing what it measured. Each case is a script of its own in bench/hostile/ (run one alone
# as `bench/hostile/NAME.sh`); every loop in them is bounded in count and time, and every
# process they start is stopped on exit.
#
# Usage: bench/hostile.sh [NAME ...]   (default: every bench/hostile/*.sh, in name order)
# RANKGATE=PATH runs that binary instead of building target/release/rankgate.
# Needs python3 and curl; the flood cases raise `ulimit -n` and want nginx for their
# comparison (skipped, and said so, without it).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${RANKGATE:-}" ]; then
  cargo build --release --locked --bin rankgate >&2
  export RANKGATE=target/release/rankgate
fi
cases=("$@")
if [ ${#cases[@]} -eq 0 ]; then
  for f in bench/hostile/*.sh; do cases+=("$(basename "$f" .sh)"); done
fi
failed=()
for c in "${cases[@]}"; do
  echo "## $c"
  echo
  start=$(date +%s)
  if ! bash "bench/hostile/$c.sh"; then failed+=("$c"); fi
  echo
  echo "($c: $(( $(date +%s) - start )) s)"
  echo
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "cases that did not run to the end: ${failed[*]}" >&2
  exit 1
fi
