#!/usr/bin/env bash
# Per-core proxy benchmark, the way operators compare proxies: the proxy under test alone on
# CPU 0 (taskset), wrk and the fake engine (nginx `return 200`, also serving a real vLLM DP=2
# /metrics capture for rankgate's telemetry) on CPU 1. Targets, in alternating rounds:
#   nginx      nginx as a reverse proxy, 1 worker, keep-alive upstream pool (the reference)
#   bare       examples/bare_proxy.rs: a hyper proxy with no routing logic
#   vllm       rankgate, vLLM flavor: rank in a header, body streamed through
#   shared     the same with server.thread_per_core = false (one multi-thread runtime)
#   sglang     rankgate, SGLang flavor: body read, rank written into it
#   models     rankgate in front of two engines serving different models: the body is scanned
#              for `model` on every request
# Per target and round: req/s, CPU µs per request (the process's user+system time over the
# requests wrk completed), wrk's p50/p99 latency, and the process's peak RSS; then each target's
# median over the rounds, as ratios to nginx's in the same rounds, with the spread.
#
# MODE=stream is the token relay instead: STREAMS (200) SSE chat completions at a time from the
# load client, WAVES (10) times over, each of TOKENS (50) events the simulated engine paces (RATE,
# default 150 tokens/s per request, comes out near 50/s at this batch size: the client's
# inter-token p50 is shown), through nginx (proxy_buffering off), the lean hyper proxy
# (examples/lean_proxy.rs) and rankgate; per target and round the proxy's CPU µs per relayed
# event (user+system time over the events the client received), then the medians and the ratio
# to nginx in the same rounds. Each load run is bounded at 120 s.
#
# Needs nginx, wrk, taskset and 2+ CPUs. Loopback only; every run bounded by DURATION.
# Usage: bench/proxy.sh [DURATION_SECONDS=8] [CONNECTIONS=64] [ROUNDS=3]
# TARGETS="nginx vllm" limits the targets. PIN=0 runs the same rounds with nothing pinned;
# bench/overhead.sh is the older unpinned comparison (before/after builds, profiles).
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${1:-8}
CONNS=${2:-64}
ROUNDS=${3:-3}
TARGETS=${TARGETS:-nginx bare vllm shared sglang models}
for t in nginx wrk taskset python3 curl; do
  command -v "$t" >/dev/null || { echo "needs $t" >&2; exit 2; }
done
[ "$(nproc --all)" -ge 2 ] || { echo "needs 2 CPUs" >&2; exit 2; }
cargo build --release --quiet --bin rankgate --example bare_proxy

. bench/lib.sh

if [ "${MODE:-requests}" = stream ]; then
  STREAMS=${STREAMS:-200}; TOKENS=${TOKENS:-50}; RATE=${RATE:-150}; WAVES=${WAVES:-10}
  TARGETS=${STREAM_TARGETS:-nginx lean vllm}
  cargo build --release --quiet --example lean_proxy
  SIM=$(free_port)
  declare -A PORT PID
  for t in nginx lean vllm; do PORT[$t]=$(free_port); done
  ADMIN_PORT=$(free_port)
  if [ "${PIN:-1}" = 0 ]; then ON_0=; ON_1=; else ON_0="taskset -c 0"; ON_1="taskset -c 1"; fi
  $ON_1 target/release/rankgate mock-engine --listen "127.0.0.1:$SIM" --flavor vllm --dp-size 2 \
    --decode-rate "$RATE" --prefill-rate 1000000 --capacity-tokens 100000000 2>/dev/null & pids+=($!)
  for _ in $(seq 100); do curl -s -o /dev/null "127.0.0.1:$SIM/v1/models" && break; sleep 0.1; done
  proxy_conf 1 "${PORT[nginx]}" "$SIM" | sed 's/proxy_set_header Connection "";/proxy_set_header Connection ""; proxy_buffering off;/' > "$work/nginx.conf"
  printf '[server]\nlisten = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\n[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "vllm"\ndp_size = 2\n' \
    "${PORT[vllm]}" "$ADMIN_PORT" "$SIM" > "$work/vllm.toml"
  for t in $TARGETS; do
    case $t in
      nginx) $ON_0 nginx -c "$work/nginx.conf" -p "$work" & ;;
      lean) $ON_0 target/release/examples/lean_proxy "127.0.0.1:${PORT[lean]}" "127.0.0.1:$SIM" & ;;
      vllm) RUST_LOG=error $ON_0 target/release/rankgate serve --config "$work/vllm.toml" & ;;
      *) echo "unknown stream target $t" >&2; exit 2 ;;
    esac
    pids+=($!); PID[$t]=$!
  done
  if [[ " $TARGETS " == *" vllm "* ]]; then
    for _ in $(seq 100); do curl -sf "127.0.0.1:$ADMIN_PORT/ready" >/dev/null && break; sleep 0.1; done
  fi
  if [[ " $TARGETS " == *" nginx "* ]]; then
    for _ in $(seq 50); do w=$(pgrep -P "${PID[nginx]}" | head -1 || true); [ -n "$w" ] && break; sleep 0.1; done
    PID[nginx]=$w
  fi
  stream_load() { # target requests -> events received (ok streams x TOKENS)
    $ON_1 target/release/rankgate load --url "http://127.0.0.1:${PORT[$1]}" --concurrency "$STREAMS" \
      --requests "$2" --prompt-tokens 16 --output-tokens "$TOKENS" --duration 120s \
      --json "$work/out.json" >/dev/null 2>&1 || true
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["ok"] * int(sys.argv[2]), sum(r["errors"].values()) if r["errors"] else 0, r["itl_ms"]["p50"])' "$work/out.json" "$TOKENS"
  }
  N=$((STREAMS * WAVES))
  for t in $TARGETS; do stream_load "$t" "$STREAMS" >/dev/null; done   # warm up
  results=()
  for r in $(seq "$ROUNDS"); do
    for t in $TARGETS; do
      c0=$(cpu_ticks "${PID[$t]}"); read -r events errs itl < <(stream_load "$t" "$N"); c1=$(cpu_ticks "${PID[$t]}")
      results+=("$r,$t,$((c1 - c0)),$events,$errs,$itl")
    done
  done
  python3 - "$(getconf CLK_TCK)" "$STREAMS" "$TOKENS" "$WAVES" "${results[@]}" <<'PY'
import statistics, sys
from collections import defaultdict
hz, streams, tokens, waves = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
rows, order = defaultdict(dict), []
for line in sys.argv[5:]:
    r, t, ticks, events, errs, itl = line.split(",")
    order += [t] if t not in order else []
    rows[int(r)][t] = dict(us=int(ticks) / hz * 1e6 / max(int(events), 1), events=int(events), errs=int(errs), itl=float(itl))
print(f"{len(rows)} rounds, {streams} SSE streams at a time ({waves} waves), {tokens} events each; proxy on CPU 0, engine and client on CPU 1")
print("| target | CPU µs per relayed event (median) | vs nginx (median, min-max) | events per round | inter-token p50 ms | errors |")
print("|---|---|---|---|---|---|")
for t in order:
    vals = [rows[r][t] for r in sorted(rows)]
    us = statistics.median(v["us"] for v in vals)
    if "nginx" in order:
        ratios = [rows[r][t]["us"] / rows[r]["nginx"]["us"] for r in sorted(rows)]
        rel = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
    else:
        rel = "-"
    print(f"| {t} | {us:.1f} | {rel} | {statistics.median(v['events'] for v in vals):.0f} | {statistics.median(v['itl'] for v in vals):.1f} | {sum(v['errs'] for v in vals)} |")
PY
  exit 0
fi

UP=$(free_port); UP2=$(free_port)
declare -A PORT ADMIN PID
for t in nginx bare vllm shared sglang models; do PORT[$t]=$(free_port); ADMIN[$t]=$(free_port); done
upstream_conf "$UP" "$UP2" > "$work/upstream.conf"
proxy_conf 1 "${PORT[nginx]}" "$UP" > "$work/nginx.conf"
rankgate_conf() { # target flavor extra-engine
  printf '[server]\nlisten = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\n' "${PORT[$1]}" "${ADMIN[$1]}"
  printf '[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "%s"\ndp_size = 2\ntelemetry = ["prometheus"]\n' "$UP" "$2"
  if [ -n "${3:-}" ]; then
    printf '[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "%s"\ndp_size = 2\nstart_rank = 2\ntelemetry = ["prometheus"]\n' "$UP2" "$2"
  fi
}
rankgate_conf vllm vllm > "$work/vllm.toml"
rankgate_conf shared vllm | sed 's/^\[server\]$/[server]\nthread_per_core = false/' > "$work/shared.toml"
rankgate_conf sglang sglang > "$work/sglang.toml"
rankgate_conf models vllm two > "$work/models.toml"
cat > "$work/post.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"tiny-llama","messages":[{"role":"user","content":"hello"}],"max_tokens":8}'
LUA

# The engines and the load generator on CPU 1; every proxy on CPU 0 (PIN=0: nothing pinned,
# all share every CPU; nginx still has one worker).
if [ "${PIN:-1}" = 0 ]; then ON_0=; ON_1=; else ON_0="taskset -c 0"; ON_1="taskset -c 1"; fi
$ON_1 nginx -c "$work/upstream.conf" -p "$work" & pids+=($!)
for t in $TARGETS; do
  case $t in
    nginx) $ON_0 nginx -c "$work/nginx.conf" -p "$work" & ;;
    bare) $ON_0 target/release/examples/bare_proxy "127.0.0.1:${PORT[bare]}" "127.0.0.1:$UP" & ;;
    vllm|shared|sglang|models) RUST_LOG=error $ON_0 target/release/rankgate serve --config "$work/$t.toml" & ;;
    *) echo "unknown target $t" >&2; exit 2 ;;
  esac
  pids+=($!); PID[$t]=$!
done
for t in $TARGETS; do
  case $t in vllm|shared|sglang|models)
    for _ in $(seq 100); do curl -sf "127.0.0.1:${ADMIN[$t]}/ready" >/dev/null && break; sleep 0.1; done
    curl -sf "127.0.0.1:${ADMIN[$t]}/ready" >/dev/null || { echo "$t not ready" >&2; exit 1; } ;;
  esac
done
if [[ " $TARGETS " == *" models "* ]]; then  # routing by model starts once both lists are in
  for _ in $(seq 100); do curl -s "127.0.0.1:${PORT[models]}/v1/models" | grep -q other-model && break; sleep 0.1; done
fi
# nginx's master process forks its worker: measure the worker (the one child).
if [[ " $TARGETS " == *" nginx "* ]]; then
  for _ in $(seq 50); do w=$(pgrep -P "${PID[nginx]}" | head -1 || true); [ -n "$w" ] && break; sleep 0.1; done
  PID[nginx]=$w
fi

peak_kb() { awk '/VmHWM/ {print $2}' "/proc/$1/status"; }
load() { $ON_1 wrk -t1 -c"$CONNS" -d"$2" --latency -s "$work/post.lua" "http://127.0.0.1:${PORT[$1]}/v1/chat/completions"; }
for t in $TARGETS; do load "$t" 2s >/dev/null; done   # warm pools and caches
hz=$(getconf CLK_TCK)
results=()
for r in $(seq "$ROUNDS"); do
  for t in $TARGETS; do
    results+=("$r,$t,$(measure_wrk "$t" "${PID[$t]}" "${DURATION}s"),$(peak_kb "${PID[$t]}")")
  done
done
python3 - "$hz" "$DURATION" "$CONNS" "${results[@]}" <<'PY'
import os, statistics, sys
from collections import defaultdict
hz, duration, conns = int(sys.argv[1]), sys.argv[2], sys.argv[3]
rows = defaultdict(dict)
order = []
for line in sys.argv[4:]:
    r, t, rps, ticks, n, p50, p99, errs, hwm = line.split(",")
    if t not in order:
        order.append(t)
    rows[int(r)][t] = dict(rps=float(rps), cpu=int(ticks) / hz * 1e6 / max(int(n), 1),
                          p50=float(p50), p99=float(p99), rss=int(hwm) / 1024, errs=int(errs))
print(f"{len(rows)} rounds of {duration} s, {conns} connections, " + ("proxy pinned to CPU 0, wrk and engine on CPU 1" if os.environ.get("PIN", "1") != "0" else "nothing pinned"))
print("| target | req/s (median) | vs nginx (median, min-max) | CPU µs/request | p50 ms | p99 ms | peak RSS MiB |")
print("|---|---|---|---|---|---|---|")
for t in order:
    vals = [rows[r][t] for r in sorted(rows)]
    med = lambda k: statistics.median(v[k] for v in vals)
    if "nginx" in order:
        ratios = [rows[r][t]["rps"] / rows[r]["nginx"]["rps"] for r in sorted(rows)]
        rel = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
    else:
        rel = "-"
    bad = sum(v["errs"] for v in vals)
    flag = f" ({bad} runs reported errors)" if bad else ""
    print(f"| {t} | {med('rps'):.0f} | {rel} | {med('cpu'):.1f} | {med('p50'):.2f} | {med('p99'):.2f} | {max(v['rss'] for v in vals):.0f} |{flag}")
PY
