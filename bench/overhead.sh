#!/usr/bin/env bash
# Proxy overhead benchmark: wrk against (1) an upstream directly, (2) nginx proxying to it,
# (3) a bare hyper proxy with no routing logic (examples/bare_proxy.rs, same server loop and client),
# (4) rankgate proxying to it (least_kv over 2 DP ranks, telemetry polled every 250 ms).
# The upstream is nginx answering a fixed JSON body and serving a real vLLM DP=2 /metrics
# capture, so the figures are the proxies' cost, not an engine's.
#
# Needs nginx and wrk (Debian: apt-get install nginx-light wrk). Loopback only; each run is
# bounded by DURATION. Usage: bench/overhead.sh [DURATION_SECONDS] [CONNECTIONS]
# PERF_OUT=/tmp/perf.data also records a CPU profile of rankgate during its run.
# FLAVOR=sglang makes rankgate pin through the body (read, parsed and rewritten per request).
# BEFORE=/path/to/an/older/rankgate also runs that binary, same config, in the same run: a
# before/after comparison of the request path measured against the same bare proxy.
# ROUNDS=N then repeats bare, rankgate (and BEFORE) back to back N more times and prints each
# round's ratio and the spread: neighbouring runs share the machine's mood, so per-round ratios
# are steadier than runs minutes apart.
# MODELS=2 also runs rankgate in front of two engines serving different models, in the same run
# (in the BEFORE slot, labelled "2 models"): it then reads each request's model from its body
# (the scan) to route it, where the one-model fleet is not scanned.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${1:-10}
CONNS=${2:-32}
command -v nginx >/dev/null && command -v wrk >/dev/null || { echo "needs nginx and wrk" >&2; exit 2; }
cargo build --release --quiet --bin rankgate --example bare_proxy

. bench/lib.sh
UP=$(free_port); UP2=$(free_port); NGX=$(free_port); RG=$(free_port); ADMIN=$(free_port); BARE=$(free_port)
OLD=$(free_port); OLDADMIN=$(free_port)
upstream_conf "$UP" "$UP2" > "$work/upstream.conf"
proxy_conf 2 "$NGX" "$UP" > "$work/proxy.conf"
cat > "$work/rankgate.toml" <<CONF
[server]
listen = "127.0.0.1:$RG"
admin_listen = "127.0.0.1:$ADMIN"
[[engines]]
url = "http://127.0.0.1:$UP"
flavor = "${FLAVOR:-vllm}"
dp_size = 2
telemetry = ["prometheus"]
CONF
sed -e "s/127.0.0.1:$RG/127.0.0.1:$OLD/" -e "s/127.0.0.1:$ADMIN/127.0.0.1:$OLDADMIN/" "$work/rankgate.toml" > "$work/before.toml"
export LABEL=BEFORE
if [ "${MODELS:-1}" = 2 ]; then
  BEFORE=target/release/rankgate; LABEL="2 models"
  printf '[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "%s"\ndp_size = 2\nstart_rank = 2\ntelemetry = ["prometheus"]\n' "$UP2" "${FLAVOR:-vllm}" >> "$work/before.toml"
fi
cat > "$work/post.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"tiny-llama","messages":[{"role":"user","content":"hello"}],"max_tokens":8}'
LUA

nginx -c "$work/upstream.conf" -p "$work" & pids+=($!)
nginx -c "$work/proxy.conf" -p "$work" & pids+=($!)
target/release/examples/bare_proxy "127.0.0.1:$BARE" "127.0.0.1:$UP" & BAREPID=$!; pids+=($BAREPID)
RUST_LOG=error target/release/rankgate serve --config "$work/rankgate.toml" & RGPID=$!; pids+=($RGPID)
if [ -n "${BEFORE:-}" ]; then
  RUST_LOG=error "$BEFORE" serve --config "$work/before.toml" & OLDPID=$!; pids+=($OLDPID)
fi
for _ in $(seq 100); do curl -sf "127.0.0.1:$ADMIN/ready" >/dev/null && break; sleep 0.1; done
curl -sf "127.0.0.1:$ADMIN/ready" >/dev/null || { echo "rankgate not ready" >&2; exit 1; }
if [ -n "${BEFORE:-}" ]; then
  for _ in $(seq 100); do curl -sf "127.0.0.1:$OLDADMIN/ready" >/dev/null && break; sleep 0.1; done
fi
if [ "${MODELS:-1}" = 2 ]; then  # routing by model starts once both model lists are in
  for _ in $(seq 100); do curl -s "127.0.0.1:$OLD/v1/models" | grep -q other-model && break; sleep 0.1; done
fi

run() { # name port -> prints "name req/s"
  wrk -t1 -c"$CONNS" -d"${DURATION}s" -s "$work/post.lua" "http://127.0.0.1:$2/v1/chat/completions" > "$work/$1.out"
  awk '/Requests\/sec/ {print $2}' "$work/$1.out"
}
wrk -t1 -c"$CONNS" -d2s -s "$work/post.lua" "http://127.0.0.1:$RG/v1/chat/completions" >/dev/null  # warm pools
direct=$(run direct "$UP")
nginx_rps=$(run nginx "$NGX")
b0=$(cpu_ticks $BAREPID)
bare=$(run bare "$BARE")
b1=$(cpu_ticks $BAREPID)
breqs=$(awk '/requests in/ {print $1}' "$work/bare.out")
t0=$(cpu_ticks $RGPID)
if [ -n "${PERF_OUT:-}" ]; then  # optional CPU profile of rankgate during its run
  perf record -e cpu-clock -F 2000 -g -p $RGPID -o "$PERF_OUT" -- sleep "$DURATION" >/dev/null 2>&1 &
fi
rg=$(run rankgate "$RG")
t1=$(cpu_ticks $RGPID)
reqs=$(awk '/requests in/ {print $1}' "$work/rankgate.out")
hz=$(getconf CLK_TCK)
errors=$(grep -E 'Non-2xx|Socket errors' "$work/rankgate.out" || true)
lat=$(awk '/Latency/ {print $2}' "$work/rankgate.out")
python3 - "$direct" "$nginx_rps" "$rg" "$t0" "$t1" "$reqs" "$hz" "$lat" "$bare" "$b0" "$b1" "$breqs" <<'PY'
import os, sys
direct, ngx, rg, t0, t1, reqs, hz, lat, bare, b0, b1, breqs = sys.argv[1:]
direct, ngx, rg, bare = float(direct), float(ngx), float(rg), float(bare)
cpu_us = (int(t1) - int(t0)) / int(hz) * 1e6 / int(reqs)
bare_us = (int(b1) - int(b0)) / int(hz) * 1e6 / int(breqs)
print(f"direct upstream     {direct:10.0f} req/s")
print(f"nginx proxy         {ngx:10.0f} req/s  ({ngx/direct:.2f}x direct)")
print(f"bare hyper proxy    {bare:10.0f} req/s  ({bare/ngx:.2f}x nginx), CPU {bare_us:.1f} us/request")
print(f"{'rankgate (' + os.environ.get('FLAVOR', 'vllm') + ')':<20}{rg:10.0f} req/s  ({rg/ngx:.2f}x nginx, {rg/bare:.2f}x bare hyper), CPU {cpu_us:.1f} us/request, mean latency {lat}")
PY
[ -z "$errors" ] || echo "rankgate run reported: $errors"
if [ -n "${BEFORE:-}" ]; then
  wrk -t1 -c"$CONNS" -d2s -s "$work/post.lua" "http://127.0.0.1:$OLD/v1/chat/completions" >/dev/null
  o0=$(cpu_ticks $OLDPID)
  old=$(run before "$OLD")
  o1=$(cpu_ticks $OLDPID)
  oreqs=$(awk '/requests in/ {print $1}' "$work/before.out")
  python3 - "$old" "$o0" "$o1" "$oreqs" "$hz" "$bare" "$rg" <<'PY'
import sys
old, o0, o1, oreqs, hz, bare, rg = sys.argv[1:]
old, bare, rg = float(old), float(bare), float(rg)
us = (int(o1) - int(o0)) / int(hz) * 1e6 / int(oreqs)
import os
label = os.environ["LABEL"]
print(f"{'rankgate (' + label + ')':<20}{old:10.0f} req/s  ({old/bare:.2f}x bare hyper), CPU {us:.1f} us/request; rankgate/this {rg/old:.2f}x")
PY
fi
if [ "${ROUNDS:-0}" -gt 0 ]; then
  rounds=()
  for r in $(seq "$ROUNDS"); do
    b0=$(cpu_ticks $BAREPID); x=$(run bare "$BARE"); b1=$(cpu_ticks $BAREPID)
    bn=$(awk '/requests in/ {print $1}' "$work/bare.out")
    t0=$(cpu_ticks $RGPID); y=$(run rankgate "$RG"); t1=$(cpu_ticks $RGPID)
    yn=$(awk '/requests in/ {print $1}' "$work/rankgate.out")
    z=0
    if [ -n "${BEFORE:-}" ]; then z=$(run before "$OLD"); fi
    rounds+=("$x,$y,$z,$((b1-b0)),$bn,$((t1-t0)),$yn")
  done
  python3 - "$hz" "${rounds[@]}" <<'PY'
import os, statistics, sys
hz = int(sys.argv[1])
label = os.environ["LABEL"]
ratios, before = [], []
for i, r in enumerate(sys.argv[2:], 1):
    bare, rg, old, bt, bn, rt, rn = (float(v) for v in r.split(","))
    ratios.append(rg / bare)
    extra = f", {label} {old/bare:.2f}x bare" if old else ""
    if old:
        before.append(old / bare)
    print(f"round {i}: bare {bare:8.0f}  rankgate {rg:8.0f} req/s = {rg/bare:.2f}x bare{extra}; CPU {rt/hz*1e6/rn:.1f} vs {bt/hz*1e6/bn:.1f} us/request")
print(f"rankgate / bare over {len(ratios)} rounds: median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}x, max {max(ratios):.2f}x)")
if before:
    print(f"{label} / bare: median {statistics.median(before):.2f}x (min {min(before):.2f}x, max {max(before):.2f}x)")
PY
fi
curl -s "127.0.0.1:$ADMIN/metrics" | grep -E '^rankgate_requests_total.*2xx' || true
