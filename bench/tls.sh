#!/usr/bin/env bash
# TLS termination cost, rankgate against nginx in one run: the same ECDSA P-256 certificate, the
# proxy under test alone on CPU 0 (taskset), clients and the fake engine (nginx `return 200`
# with a real vLLM DP=2 /metrics capture for rankgate's telemetry) on CPU 1. Targets:
#   nginx-tls     nginx (1 worker) terminating TLS, keep-alive pool to the engine
#   rankgate-tls  rankgate with [server.tls], vLLM flavor
#   nginx, rankgate  the same over cleartext, for what TLS adds to each
# Per target, in alternating rounds:
#   handshakes  `openssl s_time -new`: a full TLS 1.3 handshake per connection, nothing sent;
#               connections/s and the proxy's CPU µs per handshake
#   requests    wrk over keep-alive connections (https for the TLS targets): req/s, the proxy's
#               CPU µs per request, p50/p99
# then each target's median over the rounds, as ratios to nginx's in the same rounds.
#
# Needs nginx, wrk, openssl, taskset and 2+ CPUs. Loopback only; every run bounded.
# Usage: bench/tls.sh [DURATION_SECONDS=5] [CONNECTIONS=64] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${1:-5}
CONNS=${2:-64}
ROUNDS=${3:-3}
for t in nginx wrk openssl taskset python3 curl; do
  command -v "$t" >/dev/null || { echo "needs $t (apt-get install nginx-light wrk)" >&2; exit 2; }
done
[ "$(nproc --all)" -ge 2 ] || { echo "needs 2 CPUs" >&2; exit 2; }
cargo build --release --quiet --bin rankgate

. bench/lib.sh
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=127.0.0.1 \
  -addext subjectAltName=IP:127.0.0.1 -keyout "$work/key.pem" -out "$work/cert.pem" 2>/dev/null
UP=$(free_port); UP2=$(free_port)
TARGETS="nginx-tls rankgate-tls nginx rankgate"
declare -A PORT ADMIN PID
for t in $TARGETS; do PORT[$t]=$(free_port); ADMIN[$t]=$(free_port); done
upstream_conf "$UP" "$UP2" > "$work/upstream.conf"
proxy_conf 1 "${PORT[nginx]}" "$UP" | sed "s|$work/px.pid|$work/px1.pid|" > "$work/nginx.conf"
proxy_conf 1 "${PORT[nginx-tls]}" "$UP" \
  | sed -e "s|$work/px.pid|$work/px2.pid|" \
        -e "s|listen 127.0.0.1:${PORT[nginx-tls]};|listen 127.0.0.1:${PORT[nginx-tls]} ssl http2; ssl_certificate $work/cert.pem; ssl_certificate_key $work/key.pem; ssl_protocols TLSv1.2 TLSv1.3;|" \
  > "$work/nginx-tls.conf"
rankgate_conf() { # target tls?
  printf '[server]\nlisten = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\n' "${PORT[$1]}" "${ADMIN[$1]}"
  if [ "$2" = tls ]; then printf '[server.tls]\ncert_file = "%s"\nkey_file = "%s"\n' "$work/cert.pem" "$work/key.pem"; fi
  printf '[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "vllm"\ndp_size = 2\ntelemetry = ["prometheus"]\n' "$UP"
}
rankgate_conf rankgate-tls tls > "$work/rankgate-tls.toml"
rankgate_conf rankgate clear > "$work/rankgate.toml"
cat > "$work/post.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"tiny-llama","messages":[{"role":"user","content":"hello"}],"max_tokens":8}'
LUA

taskset -c 1 nginx -c "$work/upstream.conf" -p "$work" & pids+=($!)
for t in $TARGETS; do
  case $t in
    nginx*) taskset -c 0 nginx -c "$work/$t.conf" -p "$work" & ;;
    rankgate*) RUST_LOG=error taskset -c 0 target/release/rankgate serve --config "$work/$t.toml" & ;;
  esac
  pids+=($!); PID[$t]=$!
done
for t in rankgate rankgate-tls; do
  for _ in $(seq 100); do curl -sf "127.0.0.1:${ADMIN[$t]}/ready" >/dev/null && break; sleep 0.1; done
  curl -sf "127.0.0.1:${ADMIN[$t]}/ready" >/dev/null || { echo "$t not ready" >&2; exit 1; }
done
# nginx's master forks its worker: measure the worker.
for t in nginx nginx-tls; do
  for _ in $(seq 50); do w=$(pgrep -P "${PID[$t]}" | head -1 || true); [ -n "$w" ] && break; sleep 0.1; done
  PID[$t]=$w
done
url() { case $1 in *-tls) echo "https://127.0.0.1:${PORT[$1]}/v1/chat/completions" ;; *) echo "http://127.0.0.1:${PORT[$1]}/v1/chat/completions" ;; esac; }
for t in $TARGETS; do
  code=$(curl -sk -o /dev/null -w '%{http_code}' -H 'content-type: application/json' \
    -d '{"model":"tiny-llama","messages":[]}' "$(url "$t")")
  [ "$code" = 200 ] || { echo "$t answered $code" >&2; exit 1; }
done
load() { taskset -c 1 wrk -t1 -c"$CONNS" -d"$2" --latency -s "$work/post.lua" "$(url "$1")"; }
shake() { taskset -c 1 timeout $((DURATION + 10)) openssl s_time -connect "127.0.0.1:${PORT[$1]}" -new -time "$DURATION" 2>/dev/null; }
for t in $TARGETS; do load "$t" 2s >/dev/null; done   # warm pools and caches
hz=$(getconf CLK_TCK)
results=()
for r in $(seq "$ROUNDS"); do
  for t in $TARGETS; do
    hs=0; hcpu=0
    case $t in *-tls)
      c0=$(cpu_ticks "${PID[$t]}")
      shake "$t" > "$work/shake"
      c1=$(cpu_ticks "${PID[$t]}")
      hs=$(awk '/connections in [0-9.]+ real seconds/ {print $1; exit}' "$work/shake")
      hcpu=$((c1 - c0)) ;;
    esac
    results+=("$r,$t,${hs:-0},$hcpu,$(measure_wrk "$t" "${PID[$t]}" "${DURATION}s")")
  done
done
python3 - "$hz" "$DURATION" "$CONNS" "${results[@]}" <<'PY'
import statistics, sys
from collections import defaultdict
hz, duration, conns = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
rows = defaultdict(dict)
order = []
for line in sys.argv[4:]:
    r, t, hs, hcpu, rps, ticks, n, p50, p99, errs = line.split(",")
    if t not in order:
        order.append(t)
    hs = int(hs or 0)
    rows[int(r)][t] = dict(hs=hs / duration, hcpu=int(hcpu) / hz * 1e6 / max(hs, 1),
                          rps=float(rps), cpu=int(ticks) / hz * 1e6 / max(int(n), 1),
                          p50=float(p50), p99=float(p99), errs=int(errs))
rounds = sorted(rows)
med = lambda t, k: statistics.median(rows[r][t][k] for r in rounds)
def rel(t, ref, k):
    x = [rows[r][t][k] / rows[r][ref][k] for r in rounds]
    return f"{statistics.median(x):.2f}x ({min(x):.2f}-{max(x):.2f})"
print(f"{len(rounds)} rounds of {duration:g} s; proxy on CPU 0, clients and engine on CPU 1; ECDSA P-256, TLS 1.3")
print()
print("| target | handshakes/s | vs nginx-tls | proxy CPU µs/handshake |")
print("|---|---|---|---|")
for t in ("nginx-tls", "rankgate-tls"):
    print(f"| {t} | {med(t, 'hs'):.0f} | {rel(t, 'nginx-tls', 'hs')} | {med(t, 'hcpu'):.0f} |")
print()
print(f"| target | req/s ({conns} keep-alive conns) | vs nginx same transport | CPU µs/request | p50 ms | p99 ms |")
print("|---|---|---|---|---|---|")
for t in order:
    ref = "nginx-tls" if t.endswith("-tls") else "nginx"
    bad = sum(rows[r][t]["errs"] for r in rounds)
    flag = f" ({bad} runs reported errors)" if bad else ""
    print(f"| {t} | {med(t, 'rps'):.0f} | {rel(t, ref, 'rps')} | {med(t, 'cpu'):.1f} | {med(t, 'p50'):.2f} | {med(t, 'p99'):.2f} |{flag}")
print()
for t, clear in (("nginx-tls", "nginx"), ("rankgate-tls", "rankgate")):
    print(f"TLS costs {t.split('-')[0]} {med(t, 'cpu') - med(clear, 'cpu'):.1f} µs of CPU per keep-alive request ({rel(t, clear, 'rps')} of its cleartext req/s)")
PY
