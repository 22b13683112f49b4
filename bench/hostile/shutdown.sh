#!/usr/bin/env bash
# Streams cut by a shutdown: 20 streaming chats (200 tokens at 10 tokens/s: 20 s each) open
# when rankgate gets SIGTERM with a 2 s drain grace, then again when a second signal comes
# during a 60 s grace. Prints how each stream ended: with rankgate's ShuttingDown error event
# (what a client can tell from a complete answer), with [DONE], or silently.
set -euo pipefail
cd "$(dirname "$0")/../.."
RANKGATE=${RANKGATE:-target/release/rankgate}
[ -x "$RANKGATE" ] || cargo build --release --locked --bin rankgate >&2
# The work directory, the processes stopped on exit, free_port.
source bench/lib.sh

engine=$(free_port)
mock_vllm "$engine" "$work/engine.log" --decode-rate 10

run() { # name signals grace
  local name=$1 signals=$2 grace=$3 front admin rg
  front=$(free_port); admin=$(free_port)
  cat >"$work/$name.toml" <<CONF
[server]
listen = "127.0.0.1:$front"
admin_listen = "127.0.0.1:$admin"
drain_grace = "$grace"
[telemetry]
interval = "100ms"
[[engines]]
url = "http://127.0.0.1:$engine"
flavor = "vllm"
dp_size = 2
CONF
  "$RANKGATE" serve --config "$work/$name.toml" >"$work/$name.log" 2>&1 &
  rg=$!; pids+=($rg)
  wait_http "http://127.0.0.1:$admin/ready"
  for i in $(seq 20); do
    curl -sN --max-time 30 "http://127.0.0.1:$front/v1/chat/completions" -H 'content-type: application/json' \
      -d '{"model":"tiny-llama","stream":true,"max_tokens":200,"messages":[{"role":"user","content":"hi"}]}' \
      >"$work/$name.$i.out" 2>/dev/null &
    pids+=($!)
  done
  # Every stream has its first token before the signal.
  for _ in $(seq 100); do
    [ "$(grep -l '^data: {' "$work/$name".*.out 2>/dev/null | wc -l)" -ge 20 ] && break; sleep 0.1
  done
  local t0; t0=$(date +%s.%N)
  kill -TERM "$rg"
  if [ "$signals" = 2 ]; then sleep 0.5; kill -INT "$rg"; fi
  local code=0; wait "$rg" || code=$?
  local took; took=$(python3 -c "import time; print(f'{time.time() - $t0:.2f}')")
  sleep 0.2
  local event=0 done=0 silent=0
  for i in $(seq 20); do
    last=$(grep '^data: ' "$work/$name.$i.out" | tail -1 || true)
    case "$last" in
      *'"ShuttingDown"'*) event=$((event + 1)) ;;
      'data: [DONE]') done=$((done + 1)) ;;
      *) silent=$((silent + 1)) ;;
    esac
  done
  printf '| %s | %s | %s s | %s | %s | %s |\n' "$name" "$code" "$took" "$event" "$done" "$silent"
}

echo "| case | exit | signal to exit | ended with the error event | [DONE] | ended silently |"
echo "|---|---|---|---|---|---|"
run drain-end 1 2s
run second-signal 2 60s
