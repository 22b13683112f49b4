#!/usr/bin/env bash
# gRPC proxy overhead: streaming Generate calls from the load client (`rankgate load --grpc`)
# against a simulated engine in instant mode (prefill and decode a million tokens a second), first
# directly, then through rankgate's gRPC front door (least_kv over the engine's 2 DP ranks,
# GetLoads polled every 250 ms), in alternating rounds of the same run. Reports streams/s, TTFT
# p50/p99, and the CPU time rankgate and the engine spent per call (from /proc, so rankgate's
# figure is its whole cost per call: pick, rewrite of the rank field, both h2 legs).
#
# Loopback only; every run is bounded by a request count and DURATION.
# Usage: bench/grpc.sh [REQUESTS] [CONCURRENCY] [OUTPUT_TOKENS]; ROUNDS=N (default 3).
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${1:-20000}
CONC=${2:-32}
TOKENS=${3:-8}
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-120s}
cargo build --release --quiet --bin rankgate

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
HTTP=$(free_port); G=$(free_port); RG=$(free_port); ADMIN=$(free_port); RGG=$(free_port)

target/release/rankgate mock-engine --listen 127.0.0.1:$HTTP --grpc-listen 127.0.0.1:$G \
  --flavor vllm --dp-size 2 --decode-rate 1000000 --prefill-rate 1000000000 \
  --capacity-tokens 100000000 >"$work/engine.log" 2>&1 &
pids+=($!); ENGINE=$!
cat > "$work/rankgate.toml" <<CONF
[server]
listen = "127.0.0.1:$RG"
admin_listen = "127.0.0.1:$ADMIN"
grpc_listen = "127.0.0.1:$RGG"
[[engines]]
grpc_url = "http://127.0.0.1:$G"
flavor = "vllm"
dp_size = 2
CONF
RUST_LOG=warn target/release/rankgate serve --config "$work/rankgate.toml" >"$work/rankgate.log" 2>&1 &
pids+=($!); ROUTER=$!
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$ADMIN/ready" >/dev/null && break
  sleep 0.1
done
curl -sf "http://127.0.0.1:$ADMIN/ready" >/dev/null || { echo "rankgate never became ready" >&2; cat "$work/rankgate.log" >&2; exit 1; }

# CPU ticks (user + system) of a process so far.
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
HZ=$(getconf CLK_TCK)

run() { # label url
  local e0 r0 e1 r1
  e0=$(ticks $ENGINE); r0=$(ticks $ROUTER)
  target/release/rankgate load --grpc vllm --url "$2" --concurrency "$CONC" --requests "$REQUESTS" \
    --prompt-tokens 16 --output-tokens "$TOKENS" --duration "$DURATION" --json "$work/out.json" >/dev/null 2>&1
  e1=$(ticks $ENGINE); r1=$(ticks $ROUTER)
  python3 - "$1" "$work/out.json" "$((e1 - e0))" "$((r1 - r0))" "$HZ" <<'PY'
import json, sys
label, path, engine_ticks, router_ticks, hz = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
r = json.load(open(path))
ok = max(r["ok"], 1)
us = lambda t: t / hz / ok * 1e6
print(f"| {label} | {r['ok']} | {sum(r['errors'].values()) if r['errors'] else 0} | {r['requests_per_s']:.0f} | "
      f"{r['ttft_ms']['p50']:.2f} | {r['ttft_ms']['p99']:.2f} | {us(engine_ticks):.0f} | "
      f"{us(router_ticks) if label != 'direct' else 0:.0f} |")
PY
}

echo "gRPC Generate, $REQUESTS calls x $TOKENS tokens, $CONC concurrent, $ROUNDS rounds ($(nproc) cores)"
echo
echo "| target | ok | errors | streams/s | TTFT p50 ms | TTFT p99 ms | engine CPU µs/call | rankgate CPU µs/call |"
echo "|---|---|---|---|---|---|---|---|"
for _ in $(seq "$ROUNDS"); do
  run direct "http://127.0.0.1:$G"
  run rankgate "http://127.0.0.1:$RGG"
done
