#!/usr/bin/env bash
# Instructions per proxied request, counted by valgrind's callgrind: the same binary and input
# give the same count whatever else the machine runs, where wall-clock figures on a shared
# 2-core machine swing 30-50%. Each proxy runs alone under callgrind; one client sends requests
# one after another on ONE keep-alive connection; callgrind dumps (and so zeroes) its
# counters after a warm-up and again after the measured requests, so the figure is (instructions in that window) / requests.
#
# Targets (the engine is nginx `return 200`, serving a real vLLM DP=2 /metrics capture):
#   nginx         nginx 1.22 as a reverse proxy, one process, keep-alive upstream (the reference)
#   lean          examples/lean_proxy.rs: hyper at its leanest (current-thread, HTTP/1.1, one
#                 upstream connection per client connection, no pool): the floor
#   bare          examples/bare_proxy.rs: hyper server + hyper-util pooled client, no routing
#   vllm          rankgate, vLLM flavor (rank in a header, body streamed through)
#   vllm-flow     the same with flow control on ([flow] enabled, a fleet with room: nothing waits)
#   sglang        rankgate, SGLang flavor (body read, rank written into it)
#   models        rankgate before two engines serving different models (the body scanned)
#   stream-*      the same proxies relaying SSE streams from `rankgate mock-engine` pacing its
#                 tokens (200/s), so reads are not coalesced: instructions per relayed event
# rankgate's telemetry interval is set to 60 s for the window (a poll parses a whole /metrics
# page; at the default 250 ms, polls during the slowed-down window would be counted too).
#
# Needs valgrind, nginx, python3, curl. Loopback only; every step bounded.
# Usage: bench/instructions.sh [REQUESTS=2000]
#   TARGETS="nginx lean bare vllm sglang models stream-nginx stream-lean stream-bare stream-vllm" (the default)
# ROUTER=PATH measures that rankgate binary instead of the one built here (an A/B against
# another commit's build, run back to back).
# KEEP=DIR keeps each target's callgrind output there (callgrind_annotate DIR/vllm.callgrind).
# CG_DETAIL='--dump-instr=yes' replaces callgrind's detail options (costs per instruction, to read
# against objdump).
# CHECK=bench/instructions.expected compares the vllm figure with the one committed there and
# exits 1 when it is more than 5% above (.ci/run's guard, with REQUESTS=300 TARGETS=vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${1:-2000}
TARGETS=${TARGETS:-nginx lean bare vllm sglang models stream-nginx stream-lean stream-bare stream-vllm}
WARMUP=100
STREAMS=${STREAMS:-40}      # streamed requests per stream target
TOKENS=${TOKENS:-25}        # events per stream
for t in valgrind callgrind_control python3 curl; do
  command -v "$t" >/dev/null || { echo "needs $t" >&2; exit 2; }
done
if [[ " $TARGETS " == *nginx* ]]; then
  command -v nginx >/dev/null || { echo "needs nginx (apt-get install nginx-light)" >&2; exit 2; }
fi
cargo build --release --quiet --bin rankgate
# The bare proxy is an example, whose release build takes the dev-dependencies with it.
if [[ " $TARGETS " == *bare* ]]; then cargo build --release --quiet --example bare_proxy; fi
if [[ " $TARGETS " == *lean* ]]; then cargo build --release --quiet --example lean_proxy; fi

. bench/lib.sh
UP=$(free_port); UP2=$(free_port); SIM=$(free_port); SIMG=$(free_port)
# The engines run natively: only the proxy under test is counted.
if command -v nginx >/dev/null; then
  upstream_conf "$UP" "$UP2" > "$work/upstream.conf"
  nginx -c "$work/upstream.conf" -p "$work" & pids+=($!)
else
  # Without nginx: the simulated engine stands in for the fixed-answer engine too.
  target/release/rankgate mock-engine --listen "127.0.0.1:$UP" --flavor vllm --dp-size 2 --decode-rate 1000000 2>/dev/null & pids+=($!)
fi
target/release/rankgate mock-engine --listen "127.0.0.1:$SIM" --flavor vllm --dp-size 2 \
  --decode-rate 200 --capacity-tokens 1000000 2>/dev/null & pids+=($!)
for p in $UP $SIM; do
  for _ in $(seq 100); do curl -s -o /dev/null "127.0.0.1:$p/v1/models" && break; sleep 0.1; done
done

rankgate_conf() { # listen admin flavor upstream [second-upstream]
  printf '[server]\nlisten = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\n' "$1" "$2"
  printf '[telemetry]\ninterval = "60s"\nstale_after = "120s"\n'
  # The engine's model fixed in the config, as its /v1/models would say it: at a 60 s interval
  # the list read at the first poll is taken at the second, so without it the window would
  # measure the first poll's state (lists pending: each request's model read for its label).
  printf '[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "%s"\ndp_size = 2\ntelemetry = ["prometheus"]\n' "$4" "$3"
  printf 'models = ["tiny-llama"]\n'
  if [ -n "${5:-}" ]; then
    printf '[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "%s"\ndp_size = 2\ntelemetry = ["prometheus"]\n' "$5" "$3"
    printf 'models = ["other-model"]\n'
  fi
}
nginx_conf() { # listen upstream
  cat <<CONF
worker_processes 1; master_process off; daemon off; pid $work/cg-nginx.pid; error_log $work/cg-nginx.err;
events { worker_connections 1024; }
http {
  access_log off; client_body_temp_path $work/tmp; proxy_temp_path $work/tmp;
  upstream engine { server 127.0.0.1:$2; keepalive 16; }
  server { listen 127.0.0.1:$1; keepalive_requests 10000000;
    location / { proxy_pass http://engine; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; }
  }
}
CONF
}

# The client: requests one after another on one keep-alive connection. Prints the events
# (SSE data lines) it read, so a stream target's count is per event.
cat > "$work/client.py" <<'PY'
import http.client, json, sys
port, n, stream, tokens = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hello"}], "max_tokens": tokens if stream else 8}
if stream:
    body["stream"] = True
data = json.dumps(body).encode()
events = 0
for _ in range(n):
    c.request("POST", "/v1/chat/completions", data, {"Content-Type": "application/json"})
    r = c.getresponse()
    out = r.read()
    if r.status != 200:
        sys.exit(f"status {r.status}: {out[:200]!r}")
    events += out.count(b"data: ")
print(events)
PY

ir_total() { awk '/^(totals|summary):/ {print $2; exit}' "$1"; }

# Asks the process for a dump and waits until its file is complete: a process idle in epoll
# serves callgrind_control only when it next runs, so the reply alone is no proof.
dump_now() { # pid number
  callgrind_control -d "$1" >/dev/null 2>&1 || true
  for _ in $(seq 600); do
    grep -qs '^totals:' "$work/callgrind.out.$1.$2" && return 0
    sleep 0.1
  done
  echo "callgrind did not dump $1 (part $2)" >&2; exit 1
}

# measure NAME PORT STREAM PID -> "NAME instructions-per-unit units"
measure() {
  local name=$1 port=$2 stream=$3 pid=$4 n units out
  if [ "$stream" = 1 ]; then n=$STREAMS; else n=$REQUESTS; fi
  python3 "$work/client.py" "$port" "$WARMUP" "$stream" 4 >/dev/null
  # Part 1 ends the warm-up (a dump zeroes the counters); part 2 is the measured window.
  dump_now "$pid" 1
  units=$(timeout 1200 python3 "$work/client.py" "$port" "$n" "$stream" "$TOKENS")
  [ "$stream" = 1 ] || units=$n
  dump_now "$pid" 2
  out="$work/callgrind.out.$pid.2"
  if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP"; cp "$out" "$KEEP/$name.callgrind"; cp "$work/callgrind.out.$pid.1" "$KEEP/$name.warmup.callgrind"; fi
  python3 - "$name" "$(ir_total "$out")" "$units" <<'PY'
import sys
name, total, units = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
# Even nginx spends thousands of instructions per request: a count this low means the window
# missed the requests (seen once in many runs with an idle one-thread process).
if total / units < 1000:
    sys.exit(f"{name}: {total} instructions for {units} units: callgrind missed the window, run again")
print(f"{name} {total / units:.0f} {units}")
PY
}

start_target() { # NAME -> sets PORT, PID
  local name=$1 base=${1#stream-} upstream=$UP
  [ "$name" = "$base" ] || upstream=$SIM
  PORT=$(free_port); local admin; admin=$(free_port)
  local cg=(valgrind --tool=callgrind ${CG_DETAIL:---dump-instr=no --collect-jumps=no} --callgrind-out-file="$work/callgrind.out.%p")
  case $base in
    nginx) nginx_conf "$PORT" "$upstream" > "$work/cg-nginx.conf"; "${cg[@]}" nginx -c "$work/cg-nginx.conf" -p "$work" 2>/dev/null & ;;
    bare|lean) "${cg[@]}" "target/release/examples/${base}_proxy" "127.0.0.1:$PORT" "127.0.0.1:$upstream" 2>/dev/null & ;;
    vllm|sglang) rankgate_conf "$PORT" "$admin" "$base" "$upstream" > "$work/$name.toml"
      RUST_LOG=error "${cg[@]}" "${ROUTER:-target/release/rankgate}" serve --config "$work/$name.toml" 2>/dev/null & ;;
    vllm-flow) { rankgate_conf "$PORT" "$admin" vllm "$upstream"; printf '[flow]\nenabled = true\n'; } > "$work/$name.toml"
      RUST_LOG=error "${cg[@]}" "${ROUTER:-target/release/rankgate}" serve --config "$work/$name.toml" 2>/dev/null & ;;
    models) rankgate_conf "$PORT" "$admin" vllm "$UP" "$UP2" > "$work/$name.toml"
      RUST_LOG=error "${cg[@]}" "${ROUTER:-target/release/rankgate}" serve --config "$work/$name.toml" 2>/dev/null & ;;
    *) echo "unknown target $name" >&2; exit 2 ;;
  esac
  PID=$!; pids+=("$PID")
  for _ in $(seq 600); do curl -s -o /dev/null "127.0.0.1:$PORT/v1/models" && break; sleep 0.1; done
  case $base in vllm|vllm-flow|sglang|models)
    for _ in $(seq 600); do curl -sf -o /dev/null "127.0.0.1:$admin/ready" && break; sleep 0.1; done ;;
  esac
  if [ "$base" = models ]; then
    for _ in $(seq 600); do curl -s "127.0.0.1:$PORT/v1/models" | grep -q other-model && break; sleep 0.1; done
  fi
}

results=()
for t in $TARGETS; do
  start_target "$t"
  stream=0; [ "$t" = "${t#stream-}" ] || stream=1
  results+=("$(measure "$t" "$PORT" "$stream" "$PID")")
  kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true
done

python3 - "$REQUESTS" "$STREAMS" "$TOKENS" "${results[@]}" <<'PY'
import sys
requests, streams, tokens = sys.argv[1:4]
rows = [r.split() for r in sys.argv[4:]]
ref = {}
for name, per, units in rows:
    ref.setdefault("stream" if name.startswith("stream-") else "request", None)
base = {("stream" if n.startswith("stream-") else "request"): int(p) for n, p, _ in rows if n in ("nginx", "stream-nginx")}
print(f"callgrind, one keep-alive connection; {requests} requests (after 100 warm-up), {streams} streams of {tokens} events paced at 200 tokens/s")
print()
print("| target | instructions per request (per event for stream-*) | vs nginx | units measured |")
print("|---|---|---|---|")
for name, per, units in rows:
    kind = "stream" if name.startswith("stream-") else "request"
    rel = f"{int(per) / base[kind]:.2f}x" if kind in base else "-"
    print(f"| {name} | {int(per):,} | {rel} | {units} |")
PY

if [ -n "${CHECK:-}" ]; then
  got=$(printf '%s\n' "${results[@]}" | awk '$1 == "vllm" {print $2}')
  want=$(awk '$1 == "vllm" {print $2}' "$CHECK")
  [ -n "$got" ] && [ -n "$want" ] || { echo "CHECK needs the vllm target and a vllm line in $CHECK" >&2; exit 2; }
  python3 - "$got" "$want" <<'PY'
import sys
got, want = int(sys.argv[1]), int(sys.argv[2])
limit = want * 1.05
verdict = "ok" if got <= limit else "REGRESSION"
print(f"vllm path: {got:,} instructions per request; committed {want:,}, limit {limit:,.0f} (+5%): {verdict}")
sys.exit(0 if got <= limit else 1)
PY
fi
