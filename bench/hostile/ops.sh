#!/usr/bin/env bash
# Hostile config reloads (issue 30, item 14): what POST /reload does with a config path that is a
# FIFO, /dev/zero, a 70,000-engine file (over the 1 MiB cap), the largest fleet that fits under
# the cap (applied, then taken back), and two reloads at once; and whether the ranks of the
# engines that stay served ever go stale meanwhile.
#
# It starts two mock engines (DP=2 each: four served ranks), rankgate polling them every 250ms
# with the default stale_after = 2s, and a python3 watcher that samples
# GET /workers for the served ranks every 200 ms during each case. Per case it prints the reload's
# HTTP status and time, the /workers samples in which a served rank was not available, the
# slowest /workers answer, and the "telemetry stale" log lines of served ranks.
#
# The fake engines are polled like any (every 250 ms, each a refused connection): that steady
# load, not the reload, is what a large fleet of dead engines costs, and on a small machine it
# can starve the served ranks' polls; compare BIG_ENGINES=5000 with 20000.
#
# Loopback only (fake engines are 127.x.y.z:9, where nothing listens); every loop is bounded.
# Usage: bench/hostile/ops.sh [BIG_ENGINES=20000]
set -euo pipefail
cd "$(dirname "$0")/../.."
BIG=${1:-20000}
RANKGATE=${RANKGATE:-${CARGO_TARGET_DIR:-target}/release/rankgate}
[ -x "$RANKGATE" ] || cargo build --release --quiet --bin rankgate
for t in python3 curl mkfifo; do command -v "$t" >/dev/null || { echo "needs $t" >&2; exit 2; }; done

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

E1=$(free_port); E2=$(free_port); PORT=$(free_port); ADMIN=$(free_port)
export RANKGATE_OPS_TOKEN=ops-bench-token
for p in $E1 $E2; do
  "$RANKGATE" mock-engine --listen "127.0.0.1:$p" --flavor vllm --dp-size 2 >/dev/null 2>&1 & pids+=($!)
done
head() {
  printf '[server]\nlisten = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\nadmin_token_env = "RANKGATE_OPS_TOKEN"\n' "$PORT" "$ADMIN"
  printf '[telemetry]\ninterval = "250ms"\nstale_after = "2s"\n'
}
# The served engines and N fake ones (127.x.y.z:9), as one inline array (a top-level key:
# before the tables).
config() { # N
  python3 - "$1" "$E1" "$E2" <<'PY'
import sys
n, e1, e2 = int(sys.argv[1]), sys.argv[2], sys.argv[3]
out = ["engines = [", f'{{url="http://127.0.0.1:{e1}",flavor="vllm",dp_size=2}},', f'{{url="http://127.0.0.1:{e2}",flavor="vllm",dp_size=2}},']
for i in range(n):
    out.append(f'{{url="http://127.{1 + i // 62500}.{i // 250 % 250}.{1 + i % 250}:9",flavor="vllm"}},')
out.append("]")
print("\n".join(out))
PY
  head
}
CONF="$work/rankgate.toml"
config 0 > "$work/small.toml"; cp "$work/small.toml" "$CONF"
RUST_LOG=info "$RANKGATE" serve --config "$CONF" 2> "$work/log" & RG=$!; pids+=($RG)
for _ in $(seq 100); do
  n=$(curl -sf "127.0.0.1:$ADMIN/workers" | grep -o '"available"' | wc -l || true)
  [ "${n:-0}" -ge 4 ] && break; sleep 0.1
done
[ "${n:-0}" -ge 4 ] || { echo "the four served ranks did not become available" >&2; tail "$work/log" >&2; exit 1; }

# Samples /workers every 200 ms until $work/stop exists (at most 120 s): served ranks not
# available, samples, slowest answer.
cat > "$work/watch.py" <<'PY'
import json, os, sys, time, urllib.request
admin, served, stop = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
bad = total = 0; slowest = 0.0; end = time.time() + 120
while time.time() < end and not os.path.exists(stop):
    t = time.time()
    try:
        rows = json.load(urllib.request.urlopen(f"http://{admin}/workers", timeout=10))
        ok = [r for r in rows if any(r["id"].startswith(s + "@") for s in served)]
        bad += any(r["telemetry"] != "available" for r in ok) or len(ok) < 4
    except Exception:
        bad += 1
    total += 1; slowest = max(slowest, time.time() - t)
    time.sleep(max(0, 0.2 - (time.time() - t)))
print(f"{bad}/{total} {slowest * 1000:.0f}")
PY
served="http://127.0.0.1:$E1,http://127.0.0.1:$E2"
stale_lines() { grep "telemetry stale" "$work/log" | grep -c -e "127.0.0.1:$E1@" -e "127.0.0.1:$E2@" || true; }
reload() { curl -s -o "$work/answer" -w '%{http_code} %{time_total}' -m 30 -X POST \
  -H "Authorization: Bearer $RANKGATE_OPS_TOKEN" "127.0.0.1:$ADMIN/reload"; }
printf '%-34s %6s %10s %12s %12s %6s  %s\n' case status reload_ms unavail/samp workers_max stale answer
run() { # name, then the command that puts the config in place
  local name=$1; shift
  "$@"
  rm -f "$work/stop"; local before; before=$(stale_lines)
  python3 "$work/watch.py" "127.0.0.1:$ADMIN" "$served" "$work/stop" > "$work/watched" & local w=$!
  sleep 0.6
  local out; out=$(reload)
  sleep 2   # the served ranks watched for two seconds after the answer
  touch "$work/stop"; wait "$w"
  read -r unavail slowest < "$work/watched"
  local answer; answer=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d.get("error",{}).get("message") or "added %d removed %d" % (len(d.get("added",[])), len(d.get("removed",[]))))' "$work/answer" 2>/dev/null | cut -c1-90)
  printf '%-34s %6s %10.0f %12s %12s %6s  %s\n' "$name" "${out% *}" "$(echo "${out#* }" | awk '{print $1*1000}')" \
    "$unavail" "${slowest}ms" "$(( $(stale_lines) - before ))" "$answer"
}
put() { rm -f "$CONF"; "$@"; }
run "fifo (nobody writes)" put mkfifo "$CONF"
run "/dev/zero (a link to it)" put ln -s /dev/zero "$CONF"
config 70000 > "$work/huge.toml"
run "70,000 engines ($(( $(stat -c %s "$work/huge.toml") / 1024 )) KiB)" put cp "$work/huge.toml" "$CONF"
config "$BIG" > "$work/big.toml"
run "$BIG engines ($(( $(stat -c %s "$work/big.toml") / 1024 )) KiB), applied" put cp "$work/big.toml" "$CONF"
run "back to the 2 served engines" put cp "$work/small.toml" "$CONF"
# Two at once: the second is answered busy while the first runs (or after it, if it was quick).
put cp "$work/big.toml" "$CONF"
reload > "$work/first" & first=$!
sleep 0.05
second=$(curl -s -o /dev/null -w '%{http_code}' -m 30 -X POST -H "Authorization: Bearer $RANKGATE_OPS_TOKEN" "127.0.0.1:$ADMIN/reload")
wait "$first"
echo "two reloads at once ($BIG engines): the second answered $second while the first ran; the first answered $(cut -d' ' -f1 "$work/first") in $(awk '{printf "%.0f", $2*1000}' "$work/first") ms"
run "a valid reload after all that" put cp "$work/small.toml" "$CONF"
echo "rankgate RSS at the end: $(awk '/VmRSS/ {print $2 " kB"}' /proc/$RG/status), peak $(awk '/VmHWM/ {print $2 " kB"}' /proc/$RG/status)"
