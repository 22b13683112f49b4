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
# The interactive tenant sends one streamed chat every INTERVAL seconds; its TTFT is the time to
# the first SSE event with content. Passes when on's interactive TTFT p99 <= 0.5x off's.
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

export RG_PORT RG_ADMIN
cat > "$work/client.py" <<'PY'
import http.client, json, os, sys, threading, time

RG, ADMIN = int(os.environ["RG_PORT"]), int(os.environ["RG_ADMIN"])
mode, seconds, batch, interval = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])

def ready():
    try:
        c = http.client.HTTPConnection("127.0.0.1", ADMIN, timeout=5)
        c.request("GET", "/ready")
        return c.getresponse().status == 200
    except OSError:
        return False

if mode == "ready":
    sys.exit(0 if ready() else 1)

def body(max_tokens, stream, text):
    return json.dumps({"model": "tiny-llama", "stream": stream, "max_tokens": max_tokens,
                       "ignore_eos": True,
                       "messages": [{"role": "user", "content": text}]}).encode()

stop_at = time.monotonic() + seconds
lock = threading.Lock()
batch_tokens, batch_done, batch_failed = [0], [0], [0]

def batch_client(i):
    c = http.client.HTTPConnection("127.0.0.1", RG, timeout=600)
    n = 0
    while time.monotonic() < stop_at:
        n += 1
        headers = {"content-type": "application/json",
                   "x-gateway-inference-fairness-id": "batch",
                   "x-gateway-inference-objective": "batch"}
        try:
            c.request("POST", "/v1/chat/completions", body(128, False, f"batch {i} {n} tell a long story"), headers)
            r = c.getresponse()
            out = r.read()
        except OSError:
            c = http.client.HTTPConnection("127.0.0.1", RG, timeout=600)
            with lock: batch_failed[0] += 1
            continue
        with lock:
            if r.status == 200:
                batch_done[0] += 1
                batch_tokens[0] += json.loads(out)["usage"]["completion_tokens"]
            else:
                batch_failed[0] += 1

ttfts, inter_failed = [], [0]

def interactive_one(n):
    c = http.client.HTTPConnection("127.0.0.1", RG, timeout=600)
    headers = {"content-type": "application/json",
               "x-gateway-inference-fairness-id": "interactive",
               "x-gateway-inference-objective": "interactive"}
    t0 = time.monotonic()
    try:
        c.request("POST", "/v1/chat/completions", body(16, True, f"hi {n}"), headers)
        r = c.getresponse()
        if r.status != 200:
            r.read(); inter_failed[0] += 1; return
        first = None
        for line in r:
            if line.startswith(b"data: ") and b'"content"' in line and first is None:
                first = time.monotonic() - t0
        if first is None:
            inter_failed[0] += 1
        else:
            with lock: ttfts.append(first)
    except OSError:
        inter_failed[0] += 1

threads = [threading.Thread(target=batch_client, args=(i,)) for i in range(batch)]
for t in threads: t.start()
if batch:
    time.sleep(5)  # the ranks fill before the interactive tenant starts
n, inter = 0, []
while time.monotonic() < stop_at:
    n += 1
    t = threading.Thread(target=interactive_one, args=(n,)); t.start(); inter.append(t)
    time.sleep(interval)
for t in inter + threads: t.join()
ttfts.sort()
pct = lambda p: ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] * 1000 if ttfts else float("nan")
print(json.dumps({"mode": mode, "interactive": len(ttfts), "interactive_failed": inter_failed[0],
                  "ttft_p50_ms": round(pct(0.5), 1), "ttft_p99_ms": round(pct(0.99), 1),
                  "batch_done": batch_done[0], "batch_failed": batch_failed[0],
                  "batch_tokens": batch_tokens[0]}))
PY

run() { # name, flow config ("" for none), batch clients
  printf '[server]\nlisten = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\nmax_streams_per_client = 100000\n[telemetry]\nstale_after = "%s"\n[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "vllm"\ndp_size = 2\n%s\n' \
    "$RG_PORT" "$RG_ADMIN" "$STALE_AFTER" "$E_PORT" "$2" > "$work/rankgate.toml"
  start rankgate env RUST_LOG=warn "$RANKGATE" serve --config "$work/rankgate.toml"
  local t0=$SECONDS
  until python3 "$work/client.py" ready 0 0 0 2> /dev/null; do
    kill -0 "${procs[rankgate]}" 2>/dev/null || { tail -20 "$work/rankgate.log" >&2; exit 1; }
    [ $((SECONDS - t0)) -lt 60 ] || { echo "# rankgate: not ready in 60 s" >&2; exit 1; }
    sleep 1
  done
  python3 "$work/client.py" "$1" "$SECONDS_EACH" "$3" "$INTERVAL" | tee "$work/$1.json"
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
