#!/usr/bin/env bash
# Flow control on a REAL vLLM (issue 39's acceptance), by hand, never from CI: one vLLM 0.32 with
# --data-parallel-size 2 and --max-num-seqs 4 (../shared/tools/real-vllm, set up once with its
# `setup`), both cores for about 6 minutes; everything it starts is stopped on exit.
#
#   bench/flow-real.sh          # RANKGATE=path/to/rankgate to use a binary already built
#
# Three runs through rankgate, against the same engine:
#   idle  the interactive tenant alone;
#   off   a batch tenant keeping every rank full (BATCH closed-loop clients, each sending the next
#         request when its last one ends, with long answers) beside the interactive tenant, flow
#         control off: every request goes to an engine at once, which runs 4 per rank and queues
#         the rest in order;
#   on    the same with [flow] on (max_running = 4: the engine's --max-num-seqs; interactive
#         reserves RESERVE requests' room): rankgate holds what the ranks cannot run and sends
#         interactive requests first.
# Both tenants are driven by `rankgate load` (a first version drove them from Python threads,
# whose process starved for seconds on the saturated 2 cores and timed its own stalls): batch
# closed-loop with 32-token prompts and 128-token answers; interactive open-loop, Poisson at one
# streamed chat every INTERVAL seconds on average, 16-token prompts and answers, starting 5 s
# after batch. Its TTFT is the time to the first SSE event. Passes when on's interactive TTFT p99
# <= 0.5x off's.
#
# Environment: BATCH (24), SECONDS_EACH (60), INTERVAL (0.5), RESERVE (2), STALE_AFTER (rankgate's
# telemetry.stale_after, and so its poll timeout: 2s; on this 2-core machine the loaded engine's
# /metrics can take longer), and as bench/real-vllm-lib.sh says (RANKGATE, REAL_VLLM, PORT_BASE,
# START_TIMEOUT).
set -euo pipefail
cd "$(dirname "$0")/.."
BATCH="${BATCH:-24}"
SECONDS_EACH="${SECONDS_EACH:-60}"
INTERVAL="${INTERVAL:-0.5}"
RESERVE="${RESERVE:-2}"
STALE_AFTER="${STALE_AFTER:-2s}"
. bench/real-vllm-lib.sh

E_PORT=$((PB + 5)) RG_PORT=$((PB + 80)) RG_ADMIN=$((PB + 90)) E_VLLM=$((PB + 400))
free_ports $E_PORT $RG_PORT $RG_ADMIN

start engine env PORT=$E_PORT DP=2 CORES="0|1" VLLM_PORT=$E_VLLM "$REAL_VLLM" http --max-num-seqs 4
wait_models engine $E_PORT

ready() { python3 -c 'import sys, urllib.request; sys.exit(urllib.request.urlopen(sys.argv[1], timeout=5).status != 200)' "http://127.0.0.1:$RG_ADMIN/ready" 2> /dev/null; }

drive() { # name, batch clients: both tenants through rankgate with rankgate's own load client
  # Each plans its requests up front: --requests is sized to the run (batch: 50 a second, more
  # than this engine serves), not left huge.
  local url="http://127.0.0.1:$RG_PORT" batch_pid=""
  if [ "$2" -gt 0 ]; then
    "$RANKGATE" load --url "$url" --concurrency "$2" --requests $((SECONDS_EACH * 50)) --duration "${SECONDS_EACH}s" \
      --no-stream --prompt-tokens 32 --output-tokens 128 \
      --header "x-gateway-inference-fairness-id: batch" --header "x-gateway-inference-objective: batch" \
      --json "$work/$1-batch.json" > "$work/$1-batch.txt" 2>&1 &
    batch_pid=$!
    sleep 5  # the ranks fill before the interactive tenant starts
  fi
  "$RANKGATE" load --url "$url" --rate "$(python3 -c "print(1 / $INTERVAL)")" \
    --requests "$(python3 -c "print(int($SECONDS_EACH / $INTERVAL * 2))")" \
    --duration "$((SECONDS_EACH - 5))s" --prompt-tokens 16 --output-tokens 16 \
    --header "x-gateway-inference-fairness-id: interactive" \
    --header "x-gateway-inference-objective: interactive" \
    --json "$work/$1-interactive.json" > "$work/$1-interactive.txt" 2>&1
  [ -z "$batch_pid" ] || wait "$batch_pid"
  python3 - "$work" "$1" <<'PY' | tee "$work/$1.json"
import json, os, sys
w, mode = sys.argv[1], sys.argv[2]
i = json.load(open(f"{w}/{mode}-interactive.json"))
b = json.load(open(f"{w}/{mode}-batch.json")) if os.path.exists(f"{w}/{mode}-batch.json") else None
print(json.dumps({"mode": mode, "interactive": i["ok"], "interactive_failed": i["requests"] - i["ok"],
                  "ttft_p50_ms": i["ttft_ms"]["p50"], "ttft_p99_ms": i["ttft_ms"]["p99"],
                  "batch_done": b["ok"] if b else 0, "batch_failed": b["requests"] - b["ok"] if b else 0,
                  "batch_tokens": round(b["tokens_per_s"] * b["elapsed_s"]) if b else 0}))
PY
}

run() { # name, flow config ("" for none), batch clients
  printf '[server]\nlisten = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\nmax_streams_per_client = 100000\n[telemetry]\nstale_after = "%s"\n[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "vllm"\ndp_size = 2\n%s\n' \
    "$RG_PORT" "$RG_ADMIN" "$STALE_AFTER" "$E_PORT" "$2" > "$work/rankgate.toml"
  start rankgate env RUST_LOG=warn "$RANKGATE" serve --config "$work/rankgate.toml"
  local t0=$SECONDS
  until ready; do
    kill -0 "${procs[rankgate]}" 2>/dev/null || { tail -20 "$work/rankgate.log" >&2; exit 1; }
    [ $((SECONDS - t0)) -lt 60 ] || { echo "# rankgate: not ready in 60 s" >&2; exit 1; }
    sleep 1
  done
  drive "$1" "$3"
  if [ -n "$2" ]; then
    python3 -c 'import json, sys, urllib.request; f = json.load(urllib.request.urlopen(sys.argv[1])); print("# /flows:", json.dumps({o["name"]: {k: o[k] for k in ("dispatched_direct", "dispatched_after_wait", "rejected")} for o in f["objectives"]}))' "http://127.0.0.1:$RG_ADMIN/flows"
    # Where the interactive requests waited in rankgate's queue, from its wait histogram.
    python3 -c 'import sys, urllib.request; m = urllib.request.urlopen(sys.argv[1]).read().decode(); print("# interactive queue wait (le seconds: count):", " ".join(l.split("le=")[1].replace("\"}", ":") for l in m.splitlines() if l.startswith("rankgate_flow_wait_seconds_bucket") and "interactive" in l))' "http://127.0.0.1:$RG_ADMIN/metrics"
  fi
  echo "# rankgate warnings: $(grep -c WARN "$work/rankgate.log" || true) ($(grep WARN "$work/rankgate.log" | sed -E 's/.*WARN //' | cut -c1-60 | sort | uniq -c | sort -rn | head -3 | tr '\n' ';'))"
  : > "$work/rankgate.log"
  stop rankgate
}

FLOW='[flow]
enabled = true
max_running = 4
[[flow.objectives]]
name = "interactive"
priority = 100
reserve = '"$RESERVE"'
[[flow.objectives]]
name = "batch"
priority = -10
max_wait = "10m"'

run idle "" 0
run off "" "$BATCH"
run on "$FLOW" "$BATCH"

python3 - "$work" <<'PY'
import json, sys
w = sys.argv[1]
r = {m: json.load(open(f"{w}/{m}.json")) for m in ("idle", "off", "on")}
print()
print("| run | interactive TTFT p50 | p99 | p99 vs idle | batch requests | batch tokens |")
print("|---|---|---|---|---|---|")
for m in ("idle", "off", "on"):
    x = r[m]
    print(f"| {m} | {x['ttft_p50_ms']:.0f} ms | {x['ttft_p99_ms']:.0f} ms | {x['ttft_p99_ms'] / r['idle']['ttft_p99_ms']:.1f}x | {x['batch_done']} | {x['batch_tokens']} |")
ratio = r["on"]["ttft_p99_ms"] / r["off"]["ttft_p99_ms"]
tokens = r["on"]["batch_tokens"] / max(1, r["off"]["batch_tokens"])
print(f"\ninteractive TTFT p99 with flow control / without: {ratio:.2f} (pass: <= 0.5); batch tokens with / without: {tokens:.2f}")
print("PASS" if ratio <= 0.5 else "FAIL")
PY
