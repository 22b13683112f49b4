#!/usr/bin/env bash
# Floods from one client address (127.0.0.1) and what a good client from another (127.0.0.2)
# sees meanwhile, against one rankgate (RLIMIT_NOFILE 20000: max_connections 9968, 1246 per
# address) and, where nginx has the same exposure, nginx with limit_conn per address:
#   idle        COUNT sockets that connect and say nothing
#   h2-preface  COUNT sockets that send the HTTP/2 preface and nothing after
#   admin-idle  1000 idle sockets on the admin listener (256 connections, 32 per address);
#               the good client asks /ready, as a Kubernetes probe (2 s timeout) does
#   tls-half    COUNT sockets that send half a TLS ClientHello, against a second rankgate with
#               [server.tls]
# nginx (1 worker, 9968 connections, limit_conn 1246 per address) gets the idle flood; its
# limit_conn counts only connections with a request in progress, so idle sockets pass it.
# The flood client (crates/sim/examples/flood.rs) reopens each socket the server closes, for
# HOLD seconds and at most 5 x COUNT connects. The good client is curl, a new connection every
# 100 ms: p50/p99/max time to the answer, and how many got none within 5 s. RSS is read before
# each flood, at its peak (every 0.5 s) and AFTER seconds after it ended; the first three floods
# run in a row on one rankgate.
#
# One run's figures, and what they were before: docs/reliability.md ("Floods from one address").
#
# Needs curl, openssl, python3 (nginx for the comparison: apt-get install nginx-light).
# Loopback only; every loop bounded. Usage: bench/hostile/floods.sh [HOLD=10] [AFTER=30] [COUNT=20000]
set -euo pipefail
cd "$(dirname "$0")/../.."
HOLD=${1:-10}
AFTER=${2:-30}
COUNT=${3:-20000}
for t in curl openssl python3; do
  command -v "$t" >/dev/null || { echo "needs $t" >&2; exit 2; }
done
TARGET_DIR=${CARGO_TARGET_DIR:-target}
RANKGATE=${RANKGATE:-$TARGET_DIR/release/rankgate}
[ -x "$RANKGATE" ] || cargo build --release --quiet --bin rankgate
FLOOD=${FLOOD:-$TARGET_DIR/release/examples/flood}
[ -x "$FLOOD" ] || cargo build --release --quiet -p rankgate-sim --example flood
# The flood client holds COUNT sockets; rankgate gets the limit the figures were taken at.
ulimit -Hn $((COUNT + 4096)) 2>/dev/null || true
ulimit -n "$(ulimit -Hn)"
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt $((COUNT + 1000)) ]; then
  COUNT=$(( $(ulimit -n) - 1000 ))
  echo "RLIMIT_NOFILE $(ulimit -n) (hard) here: floods of $COUNT" >&2
fi

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
rss_mb() { awk '/^VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$1/status" 2>/dev/null || echo "?"; }

# Waits until URL answers (curl ARGS...), at most 10 s.
wait_up() {
  for _ in $(seq 100); do curl -sk -o /dev/null --max-time 1 "$@" && return 0; sleep 0.1; done
  echo "not answering: $*" >&2; exit 1
}

ENGINE=$(free_port)
"$RANKGATE" mock-engine --listen "127.0.0.1:$ENGINE" --flavor vllm --dp-size 2 >"$work/engine.log" 2>&1 &
pids+=($!)

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=127.0.0.1 \
  -addext subjectAltName=IP:127.0.0.1 -keyout "$work/key.pem" -out "$work/cert.pem" 2>/dev/null

# start_rankgate NAME [tls]: a rankgate on fresh ports; sets PORT, ADMIN, PID.
start_rankgate() {
  PORT=$(free_port); ADMIN=$(free_port)
  {
    printf '[server]\nlisten = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\n' "$PORT" "$ADMIN"
    if [ "${2:-}" = tls ]; then
      printf '[server.tls]\ncert_file = "%s"\nkey_file = "%s"\n' "$work/cert.pem" "$work/key.pem"
    fi
    printf '[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "vllm"\ndp_size = 2\n' "$ENGINE"
  } >"$work/$1.toml"
  (ulimit -n 20000 2>/dev/null || true; exec "$RANKGATE" serve --config "$work/$1.toml") >"$work/$1.log" 2>&1 &
  PID=$!
  pids+=("$PID")
  wait_up "http://127.0.0.1:$ADMIN/ready"
}

# probe URL SECONDS: a new curl from 127.0.0.2 every 100 ms; one "seconds status" line each.
probe() {
  local n=$(( $2 * 10 )) i
  for ((i = 0; i < n; i++)); do
    curl -sk --interface 127.0.0.2 -o /dev/null --max-time 5 -w '%{time_total} %{http_code}\n' "$1" &
    sleep 0.1
  done
  wait
}

# The probe lines as "p50 p99 max failed" (ms; failed: no answer within 5 s).
summary() {
  awk '$2 == "000" { failed++; next } { print $1 * 1000 } END { print "F", failed + 0 }' "$1" \
    | sort -g | awk '$1 == "F" { failed = $2; next } { v[n++] = $1 }
      END { if (n == 0) { print "- - - " failed; exit }
            printf "%.1f %.1f %.1f %d\n", v[int((n - 1) * 0.5)], v[int((n - 1) * 0.99)], v[n - 1], failed }'
}

# flood NAME TARGET_PORT KIND COUNT PROBE_URL PID: one flood and its row.
flood() {
  local before peak after stats p0
  before=$(rss_mb "$6"); peak=$before
  "$FLOOD" flood "127.0.0.1:$2" 127.0.0.1 "$3" "$4" "$HOLD" $(( $4 * 5 )) >"$work/flood.out" 2>&1 &
  p0=$!
  pids+=("$p0")
  # The probe begins once the flood is under way, and ends before it does.
  sleep 1
  probe "$5" $(( HOLD - 2 )) >"$work/probe.out" &
  local pp=$!
  for _ in $(seq $(( (HOLD + 20) * 2 ))); do
    kill -0 "$p0" 2>/dev/null || break
    local r; r=$(rss_mb "$6"); [ "$r" != "?" ] && [ "$r" -gt "$peak" ] && peak=$r
    sleep 0.5
  done
  wait "$p0" "$pp" || true
  sleep "$AFTER"
  after=$(rss_mb "$6")
  read -r p50 p99 max failed < <(summary "$work/probe.out")
  stats=$(sed -n 's/.*connects=\([0-9]*\) closed_by_server=\([0-9]*\) held_max=\([0-9]*\).*/\1 \2 \3/p' "$work/flood.out")
  read -r connects closed held <<<"${stats:-? ? ?}"
  printf '%-22s %6s %8s %8s %6s %6s %7s %5s %7s %6s %6s\n' "$1" "$4" "$connects" "$held" \
    "$p50" "$p99" "$max" "$failed" "$before" "$peak" "$after"
}

header() {
  printf '%-22s %6s %8s %8s %6s %6s %7s %5s %7s %6s %6s\n' target count connects held_max \
    p50ms p99ms max_ms fail rss_MB peak after
}

echo "floods from 127.0.0.1, good client from 127.0.0.2; hold ${HOLD}s, RSS read ${AFTER}s after"
header
start_rankgate plain
flood "rankgate idle" "$PORT" idle "$COUNT" "http://127.0.0.1:$PORT/v1/models" "$PID"
flood "rankgate h2-preface" "$PORT" h2-preface "$COUNT" "http://127.0.0.1:$PORT/v1/models" "$PID"
flood "rankgate admin-idle" "$ADMIN" idle 1000 "http://127.0.0.1:$ADMIN/ready" "$PID"
start_rankgate tls tls
flood "rankgate-tls tls-half" "$PORT" tls-half "$COUNT" "https://127.0.0.1:$PORT/v1/models" "$PID"

if command -v nginx >/dev/null; then
  # nginx in front of the same engine: limit_conn per address as rankgate's default, and as many
  # connections per worker as rankgate's max_connections (nginx counts its upstream ones too).
  NPORT=$(free_port)
  cat >"$work/nginx.conf" <<CONF
worker_processes 1; daemon off; pid $work/nginx.pid; error_log $work/nginx.err;
worker_rlimit_nofile 20000;
events { worker_connections 9968; }
http {
  access_log off; client_body_temp_path $work/tmp; proxy_temp_path $work/tmp;
  limit_conn_zone \$binary_remote_addr zone=perip:10m;
  server { listen 127.0.0.1:$NPORT backlog=4096; limit_conn perip 1246;
    location / { proxy_pass http://127.0.0.1:$ENGINE; proxy_http_version 1.1; } }
}
CONF
  mkdir -p "$work/tmp"
  nginx -c "$work/nginx.conf" -e "$work/nginx.err" 2>/dev/null &
  pids+=($!)
  wait_up "http://127.0.0.1:$NPORT/v1/models"
  worker=$(pgrep -P "$(cat "$work/nginx.pid")" | head -1)
  flood "nginx idle" "$NPORT" idle "$COUNT" "http://127.0.0.1:$NPORT/v1/models" "$worker"
fi
