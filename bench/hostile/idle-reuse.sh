#!/usr/bin/env bash
# Connection places are for work: floods of sockets that each sent one request and then idle,
# from several addresses, and what a good client from another address sees meanwhile, against
# one rankgate at its defaults (RLIMIT_NOFILE 20000: max_connections 9968, 1246 per address;
# the admin listener 256, 16 per address) and nginx where it has the same exposure:
#   admin-8x40     8 addresses (127.0.0.2-9) x 40 one-request sockets on the admin listener;
#                  the good client (127.0.0.10) asks /ready, as a Kubernetes probe does
#   front-8x1300   8 addresses x 1300 one-request sockets on the front door (10,400 > 9,968);
#                  the good client asks /v1/models
#   idle-19000     one address (127.0.0.2) with 19,000 silent sockets; the good client from
#                  127.0.0.10 (its resets counted apart)
#   nat-19000      the same flood, the good client from the flooder's own address (a NAT)
# nginx (1 worker, 9968 connections, keepalive_timeout 75 s, no limit_conn: its limit_conn
# counts only requests in progress) gets front-8x1300 and idle-19000.
# The flood client (crates/sim/examples/flood.rs) reopens each socket the server closes, for
# HOLD seconds and at most 3 x its count of connects. The good client is curl, a new connection
# every 100 ms while the floods hold: p50/p99/max ms to the answer, how many got none within
# 5 s, and how many of those were reset.
#
# Figures: docs/reliability.md ("Idle places are reclaimed").
# Loopback only; every loop bounded. Usage: bench/hostile/idle-reuse.sh [HOLD=12]
set -euo pipefail
cd "$(dirname "$0")/../.."
HOLD=${1:-12}
for t in curl python3; do
  command -v "$t" >/dev/null || { echo "needs $t" >&2; exit 2; }
done
TARGET_DIR=${CARGO_TARGET_DIR:-target}
RANKGATE=${RANKGATE:-$TARGET_DIR/release/rankgate}
[ -x "$RANKGATE" ] || cargo build --release --quiet --bin rankgate
FLOOD=${FLOOD:-$TARGET_DIR/release/examples/flood}
[ -x "$FLOOD" ] || cargo build --release --quiet -p rankgate-sim --example flood
ulimit -Hn 24000 2>/dev/null || true
ulimit -n "$(ulimit -Hn)"
BIG=19000
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt $((BIG + 500)) ]; then
  BIG=$(( $(ulimit -n) - 500 ))
  echo "RLIMIT_NOFILE $(ulimit -n) (hard) here: the one-address flood holds $BIG" >&2
fi

# The work directory, the processes stopped on exit, free_port.
. bench/lib.sh
wait_up() {
  for _ in $(seq 100); do curl -sk -o /dev/null --max-time 1 "$@" && return 0; sleep 0.1; done
  echo "not answering: $*" >&2; exit 1
}

ENGINE=$(free_port)
"$RANKGATE" mock-engine --listen "127.0.0.1:$ENGINE" --flavor vllm --dp-size 2 >"$work/engine.log" 2>&1 &
pids+=($!)

PORT=$(free_port); ADMIN=$(free_port)
printf '[server]\nlisten = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\n[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "vllm"\ndp_size = 2\n' \
  "$PORT" "$ADMIN" "$ENGINE" >"$work/rankgate.toml"
(ulimit -n 20000; exec "$RANKGATE" serve --config "$work/rankgate.toml") >"$work/rankgate.log" 2>&1 &
pids+=($!)
wait_up "http://127.0.0.1:$ADMIN/ready"

# probe FROM URL SECONDS: a new curl from FROM every 100 ms; "seconds status exitcode" each.
probe() {
  local n=$(( $3 * 10 )) i
  for ((i = 0; i < n; i++)); do
    curl -sk --interface "$1" -o /dev/null --max-time 5 -w '%{time_total} %{http_code} %{exitcode}\n' "$2" &
    sleep 0.1
  done
  wait
}

# The probe lines as "n p50 p99 max failed resets" (ms; failed: no answer within 5 s; resets:
# curl's 52 empty reply, 56 reset, 7 refused).
summary() {
  awk '$2 == "000" { failed++; if ($3 == 52 || $3 == 56 || $3 == 7) resets++; next }
       { print $1 * 1000 } END { print "F", failed + 0, resets + 0 }' "$1" \
    | sort -g | awk '$1 == "F" { failed = $2; resets = $3; next } { v[n++] = $1 }
      END { if (n == 0) { print "0 - - - " failed " " resets; exit }
            printf "%d %.1f %.1f %.1f %d %d\n", n + failed, v[int((n - 1) * 0.5)], v[int((n - 1) * 0.99)], v[n - 1], failed, resets }'
}

# run NAME TARGET_PORT KIND PER_ADDRESS ADDRESSES PROBE_FROM PROBE_URL: floods from
# 127.0.0.2.. (ADDRESSES of them), the probe meanwhile, one row.
run() {
  local fl=() a
  for ((a = 2; a < 2 + $5; a++)); do
    "$FLOOD" flood "127.0.0.1:$2" "127.0.0.$a" "$3" "$4" "$HOLD" $(( $4 * 3 )) >"$work/flood.$a" 2>&1 &
    fl+=($!); pids+=($!)
  done
  # The probe begins once the floods hold their sockets, and ends before they do.
  sleep 3
  (probe "$6" "$7" $(( HOLD - 5 ))) >"$work/probe.out" || true
  wait "${fl[@]}" || true
  local connects=0 held=0 c h
  for ((a = 2; a < 2 + $5; a++)); do
    read -r c h < <(sed -n 's/.*connects=\([0-9]*\) .*held_max=\([0-9]*\).*/\1 \2/p' "$work/flood.$a") || true
    connects=$(( connects + ${c:-0} )); held=$(( held + ${h:-0} ))
  done
  read -r n p50 p99 max failed resets < <(summary "$work/probe.out") || true
  printf '%-24s %9s %8s %8s %5s %7s %7s %7s %5s %6s\n' "$1" "$5x$4" "$connects" "$held" "$n" \
    "$p50" "$p99" "$max" "$failed" "$resets"
  sleep 2
}

echo "good client: a new connection every 100 ms while the floods hold (${HOLD}s)"
printf '%-24s %9s %8s %8s %5s %7s %7s %7s %5s %6s\n' target flood connects held_max asked \
  p50ms p99ms max_ms fail resets
run "rankgate admin-8x40" "$ADMIN" one-request 40 8 127.0.0.10 "http://127.0.0.1:$ADMIN/ready"
run "rankgate front-8x1300" "$PORT" one-request 1300 8 127.0.0.10 "http://127.0.0.1:$PORT/v1/models"
run "rankgate idle-19000" "$PORT" idle "$BIG" 1 127.0.0.10 "http://127.0.0.1:$PORT/v1/models"
run "rankgate nat-19000" "$PORT" idle "$BIG" 1 127.0.0.2 "http://127.0.0.1:$PORT/v1/models"
curl -s "http://127.0.0.1:$ADMIN/metrics" | grep -E '^rankgate_connections_(reclaimed|replaced|refused)_total' || true

if command -v nginx >/dev/null; then
  NPORT=$(free_port)
  cat >"$work/nginx.conf" <<CONF
worker_processes 1; daemon off; pid $work/nginx.pid; error_log $work/nginx.err;
worker_rlimit_nofile 20000;
events { worker_connections 9968; }
http {
  access_log off; client_body_temp_path $work/tmp; proxy_temp_path $work/tmp;
  server { listen 127.0.0.1:$NPORT backlog=4096;
    location / { proxy_pass http://127.0.0.1:$ENGINE; proxy_http_version 1.1; } }
}
CONF
  mkdir -p "$work/tmp"
  nginx -c "$work/nginx.conf" -e "$work/nginx.err" 2>/dev/null &
  pids+=($!)
  wait_up "http://127.0.0.1:$NPORT/v1/models"
  run "nginx front-8x1300" "$NPORT" one-request 1300 8 127.0.0.10 "http://127.0.0.1:$NPORT/v1/models"
  run "nginx idle-19000" "$NPORT" idle "$BIG" 1 127.0.0.10 "http://127.0.0.1:$NPORT/v1/models"
else
  echo "(nginx not installed: apt-get install nginx-light for the comparison)"
fi
