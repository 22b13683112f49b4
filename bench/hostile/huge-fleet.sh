#!/usr/bin/env bash
# A reload to a huge fleet of engines that do not answer (issue 38, item 3), default settings:
# is the reload answered within its deadline (control::RELOAD_DEADLINE), does the admin /ready
# stay quick meanwhile, do the two real engines' ranks ever go stale, is a reload back to the two
# applied promptly, and does the memory come back?
#
# Per kind of dead engine, a fresh rankgate serves two mock engines (DP=2 each: four real ranks)
# with the default [telemetry] (every 250 ms, stale after 2 s); then POST /reload to a file of the
# two plus N engines that do not answer:
#   refused     127.a.b.c:P where nothing listens (each connect refused at once)
#   blackholed  127.a.b.c:P where a listener never accepts and its backlog is full, so each
#               connect waits (SYNs dropped) until the poll's timeout, like an address whose
#               packets go nowhere (TEST-NET addresses are not used: on a machine with a default
#               route they reach whatever the route leads to)
# A python3 watcher asks GET /ready every 100 ms (its answer time) and GET /workers every second
# (the real ranks not "available" or "fresh") from 1 s before the reload until the fleet is back to two, and
# the log's "telemetry stale" lines of the real ranks are counted. RSS is read from
# /proc/PID/status before the reload, and 60 s after the reload back.
#
# Printed per kind: the reload's status and time, /ready p50/p99/max and how many probes got no
# answer within 10 s, /workers samples with a real rank not available, stale lines, the reload
# back (status, time to its answer, time until GET /engines lists two), RSS before, at the peak,
# and 60 s after.
#
# Loopback only; every loop bounded; every process started is stopped on exit.
# Usage: bench/hostile/huge-fleet.sh [N=20000] [KINDS="refused blackholed"] [HOLD=20]
#   INSPECT=1: glibc's malloc_stats at the end (through gdb), to tell memory in use from memory held.
#   HOLD: seconds the huge fleet is kept before the reload back.
set -euo pipefail
cd "$(dirname "$0")/../.."
N=${1:-20000}
KINDS=${2:-refused blackholed}
HOLD=${3:-20}
RANKGATE=${RANKGATE:-${CARGO_TARGET_DIR:-target}/release/rankgate}
[ -x "$RANKGATE" ] || cargo build --release --quiet --bin rankgate
for t in python3 curl; do command -v "$t" >/dev/null || { echo "needs $t" >&2; exit 2; }; done
ulimit -n 20000 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
rss_kb() { awk '/VmRSS/ {print $2}' "/proc/$1/status"; }
hwm_kb() { awk '/VmHWM/ {print $2}' "/proc/$1/status"; }

E1=$(free_port); E2=$(free_port)
export RANKGATE_OPS_TOKEN=huge-fleet-bench-token
for p in $E1 $E2; do
  "$RANKGATE" mock-engine --listen "127.0.0.1:$p" --flavor vllm --dp-size 2 >/dev/null 2>&1 & pids+=($!)
done

# The two real engines and N dead ones at port $3, as one inline array (before the tables).
config() { # N PORT ADMIN-PORT FRONT-PORT
  python3 - "$1" "$E1" "$E2" "$2" <<'PY'
import sys
n, e1, e2, port = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
out = ["engines = [", f'{{url="http://127.0.0.1:{e1}",flavor="vllm",dp_size=2}},', f'{{url="http://127.0.0.1:{e2}",flavor="vllm",dp_size=2}},']
for i in range(n):
    out.append(f'{{url="http://127.{1 + i // 62500}.{i // 250 % 250}.{1 + i % 250}:{port}",flavor="vllm"}},')
out.append("]")
print("\n".join(out))
PY
  printf '[server]\nlisten = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\nadmin_token_env = "RANKGATE_OPS_TOKEN"\n' "$4" "$3"
}

cat > "$work/watch.py" <<'PY'
# /ready every 100 ms, /workers every 1 s, until the stop file exists (at most 600 s).
import json, os, sys, time, urllib.request
admin, served, stop, out = sys.argv[1], sys.argv[2].split(","), sys.argv[3], sys.argv[4]
ready, lost, bad, samples = [], 0, 0, 0
end = time.time() + 600; next_workers = 0.0
def dump():
    ready.sort()
    q = lambda p: ready[min(len(ready) - 1, int(p * len(ready)))] * 1000 if ready else -1
    json.dump({"n": len(ready), "lost": lost, "p50": q(0.5), "p99": q(0.99), "max": q(1.0),
               "bad": bad, "samples": samples}, open(out, "w"))
while time.time() < end and not os.path.exists(stop):
    t = time.time()
    try:
        urllib.request.urlopen(f"http://{admin}/ready", timeout=10).read()
        ready.append(time.time() - t)
    except Exception:
        lost += 1
    if time.time() >= next_workers:
        next_workers = time.time() + 1.0
        samples += 1
        try:
            rows = json.load(urllib.request.urlopen(f"http://{admin}/workers", timeout=10))
            ok = [r for r in rows if any(r["id"].startswith(s + "@") for s in served)]
            # An idle mock engine's ranks are "fresh" (named, no gauges yet): routable too.
            bad += any(r["telemetry"] not in ("available", "fresh") for r in ok) or len(ok) < 4
        except Exception:
            bad += 1
    time.sleep(max(0, 0.1 - (time.time() - t)))
dump()
PY

engines_listed() { curl -s -m 10 "127.0.0.1:$ADMIN/engines" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)))' 2>/dev/null || echo "?"; }
reload() { curl -s -o "$work/answer" -w '%{http_code} %{time_total}' -m 60 -X POST \
  -H "Authorization: Bearer $RANKGATE_OPS_TOKEN" "127.0.0.1:$ADMIN/reload" || true; }

printf '%-10s %6s %9s %22s %8s %11s %6s %9s %10s %8s %12s\n' kind status reload_ms "ready p50/p99/max ms" \
  no_answer unavail/samp stale back back_ms applied_ms "RSS MB before/peak/60s"
for kind in $KINDS; do
  PORT=$(free_port); ADMIN=$(free_port); DEAD=$(free_port)
  if [ "$kind" = blackholed ]; then
    # Listens on every loopback address, never accepts: its backlog fills at the first
    # connection, and every later SYN is dropped.
    python3 -c 'import socket,sys,time
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(("0.0.0.0", int(sys.argv[1]))); l.listen(0); time.sleep(900)' "$DEAD" & pids+=($!)
  fi
  config 0 "$DEAD" "$ADMIN" "$PORT" > "$work/small.toml"
  config "$N" "$DEAD" "$ADMIN" "$PORT" > "$work/big.toml"
  CONF="$work/rankgate.toml"; cp "$work/small.toml" "$CONF"
  RUST_LOG=info "$RANKGATE" serve --config "$CONF" 2> "$work/log-$kind" & RG=$!; pids+=($RG)
  n=0
  for _ in $(seq 100); do
    n=$(curl -sf "127.0.0.1:$ADMIN/workers" | grep -oE '"telemetry":"(available|fresh)"' | wc -l || true)
    [ "${n:-0}" -ge 4 ] && break; sleep 0.1
  done
  [ "${n:-0}" -ge 4 ] || { echo "$kind: the four real ranks did not become available" >&2; tail "$work/log-$kind" >&2; exit 1; }
  sleep 3
  before=$(rss_kb "$RG")
  stale() { grep "telemetry stale" "$work/log-$kind" | grep -c -e "127.0.0.1:$E1@" -e "127.0.0.1:$E2@" || true; }
  rm -f "$work/stop"
  python3 "$work/watch.py" "127.0.0.1:$ADMIN" "http://127.0.0.1:$E1,http://127.0.0.1:$E2" "$work/stop" "$work/watched" & w=$!
  sleep 1
  cp "$work/big.toml" "$CONF"
  big=$(reload)
  sleep "$HOLD"
  cp "$work/small.toml" "$CONF"
  t0=$(date +%s.%N)
  back=$(reload)
  applied="-"
  for _ in $(seq 600); do
    if [ "$(engines_listed)" = 2 ]; then applied=$(python3 -c "import time; print(round((time.time() - $t0) * 1000))"); break; fi
    sleep 0.1
  done
  sleep 2
  touch "$work/stop"; wait "$w"
  peak=$(hwm_kb "$RG")
  sleep 60
  after=$(rss_kb "$RG")
  if [ -n "${INSPECT:-}" ]; then
    # What the 60 s RSS is made of: glibc's own count of the bytes in use and held (to stderr,
    # the log), per arena.
    gdb -p "$RG" -batch -ex 'call (void)malloc_stats()' >/dev/null 2>&1 || true
    grep -E "^(Arena|system bytes|in use bytes|Total)" "$work/log-$kind" | tail -40 >&2 || true
  fi
  p50=? p99=? max=? lost=? bad=? samples=?
  read -r p50 p99 max lost bad samples < <(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("%.0f %.0f %.0f %d %d %d" % (d["p50"], d["p99"], d["max"], d["lost"], d["bad"], d["samples"]))' "$work/watched") || echo "$kind: the watcher left no figures" >&2
  printf '%-10s %6s %9.0f %22s %8s %11s %6s %9s %10s %8s %12s\n' "$kind" "${big% *}" \
    "$(echo "${big#* }" | awk '{print $1*1000}')" "$p50/$p99/$max" "$lost" "$bad/$samples" "$(stale)" \
    "${back% *}" "$(echo "${back#* }" | awk '{print $1*1000}')" "$applied" \
    "$((before / 1024))/$((peak / 1024))/$((after / 1024))" || true
  kill "$RG" 2>/dev/null || true; wait "$RG" 2>/dev/null || true
  if [ "$kind" = blackholed ]; then kill "${pids[-2]}" 2>/dev/null || true; fi
done
