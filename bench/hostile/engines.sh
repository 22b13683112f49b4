#!/usr/bin/env bash
# An https:// engine whose TLS handshake hangs, against the release binary: what it costs the
# clients, and when it is ejected.
#
# Two engines (`rankgate mock-engine`, one rank each): the "hung" one serves HTTPS behind a small
# door (python3) that passes connections through until told to hang, then accepts new ones and
# never answers their ClientHello (telemetry keeps the connection it already has, so the engine
# still looks available and idle); the "good" one is plain HTTP and looks busier, so least_kv
# prefers the hung one. REQUESTS chat completions then go one after another; each must be
# answered, by the good engine, within about server.connect_timeout (before issue 30 it waited
# the whole response_timeout, 30 min by default, and got a 504). Printed: each request's status,
# engine and latency, the request after which the hung engine showed as ejected on /workers,
# and how many connections the door held silent.
#
# Needs python3, curl, openssl. Loopback only; every wait bounded.
# The hung engine is tried less and less as its failures weigh on its score, so routing.eject_after
# is 3 here (default 5) for the ejection to show within a short run.
# Usage: bench/hostile/engines.sh [REQUESTS=30] [CONNECT_TIMEOUT=300ms]
# RANKGATE=PATH runs that binary (default target/release/rankgate, built when absent).
set -euo pipefail
cd "$(dirname "$0")/../.."
REQUESTS=${1:-30}
CONNECT_TIMEOUT=${2:-300ms}
RANKGATE=${RANKGATE:-target/release/rankgate}
for t in python3 curl openssl; do
  command -v "$t" >/dev/null || { echo "needs $t" >&2; exit 2; }
done
[ -x "$RANKGATE" ] || cargo build --release --quiet --bin rankgate

. bench/lib.sh

# A CA and a certificate for 127.0.0.1 it signs (rustls takes no self-signed leaf as its anchor).
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=bench-ca \
  -keyout "$work/ca.key" -out "$work/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=127.0.0.1 \
  -keyout "$work/key.pem" -out "$work/req.pem" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n' > "$work/ext"
openssl x509 -req -in "$work/req.pem" -CA "$work/ca.pem" -CAkey "$work/ca.key" -CAcreateserial \
  -days 2 -extfile "$work/ext" -out "$work/cert.pem" 2>/dev/null

TLS=$(free_port); DOOR=$(free_port); GOOD=$(free_port); PORT=$(free_port); ADMIN=$(free_port)
"$RANKGATE" mock-engine --listen "127.0.0.1:$TLS" --flavor vllm --kv-usage 0.0 \
  --tls-cert "$work/cert.pem" --tls-key "$work/key.pem" 2>/dev/null & pids+=($!)
"$RANKGATE" mock-engine --listen "127.0.0.1:$GOOD" --flavor vllm --kv-usage 0.5 2>/dev/null & pids+=($!)

# The door: passes connections through to the TLS engine until $work/hang exists; after that it
# accepts and holds them without reading or answering, counting them in $work/held.
cat > "$work/door.py" <<'PY'
import asyncio, os, sys
listen, target, hang, held_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
held = []
async def pipe(r, w):
    try:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        w.close()
async def client(r, w):
    if os.path.exists(hang):
        held.append(w)
        with open(held_file, "w") as f:
            f.write(str(len(held)))
        return
    try:
        ur, uw = await asyncio.open_connection("127.0.0.1", target)
    except OSError:
        w.close()
        return
    await asyncio.gather(pipe(r, uw), pipe(ur, w))
async def main():
    server = await asyncio.start_server(client, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()
asyncio.run(main())
PY
echo 0 > "$work/held"
python3 "$work/door.py" "$DOOR" "$TLS" "$work/hang" "$work/held" & pids+=($!)

cat > "$work/rankgate.toml" <<TOML
[server]
listen = "127.0.0.1:$PORT"
admin_listen = "127.0.0.1:$ADMIN"
connect_timeout = "$CONNECT_TIMEOUT"
# The script reads which engine answered from the worker header (hidden by default).
expose_worker = "url"
[routing]
eject_after = 3
[telemetry]
interval = "100ms"
[engine_tls]
ca_file = "$work/ca.pem"
[[engines]]
url = "https://127.0.0.1:$DOOR"
flavor = "vllm"
[[engines]]
url = "http://127.0.0.1:$GOOD"
flavor = "vllm"
TOML
"$RANKGATE" serve --config "$work/rankgate.toml" 2>"$work/rankgate.log" & pids+=($!)

# /workers as "state reason_kind kv" per rank, in fleet order (the hung engine first).
workers() {
  curl -s -m 2 "127.0.0.1:$ADMIN/workers" | python3 -c '
import json, sys
for w in json.load(sys.stdin):
    print(w["telemetry"], w.get("reason_kind") or "-", w.get("kv_usage"))' 2>/dev/null || true
}
ready=""
for _ in $(seq 100); do
  w=$(workers)
  if [ "$(echo "$w" | head -1 | cut -d' ' -f1)" = available ] \
     && [ "$(echo "$w" | sed -n 2p | cut -d' ' -f3)" = 0.5 ]; then ready=1; break; fi
  sleep 0.1
done
[ -n "$ready" ] || { echo "engines not available within 10 s:" >&2; workers >&2; cat "$work/rankgate.log" >&2; exit 1; }

touch "$work/hang"
body='{"model":"tiny-llama","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
ejected_after="-"; ok=0; good=0
printf '%-8s %-7s %-10s %12s  %s\n' request status engine latency_ms hung_engine_state
: > "$work/latencies"
for i in $(seq "$REQUESTS"); do
  out=$(curl -s -m 10 -o /dev/null -D "$work/headers" -w '%{http_code} %{time_total}' \
    -H 'content-type: application/json' -d "$body" "127.0.0.1:$PORT/v1/chat/completions" || true)
  status=${out%% *}; secs=${out##* }
  worker=$(awk -F': ' 'tolower($1) == "x-rankgate-worker" {print $2}' "$work/headers" | tr -d '\r')
  case "$worker" in
    *":$GOOD@"*) engine=good ;;
    *":$DOOR@"*) engine=hung ;;
    *) engine=none ;;
  esac
  ms=$(awk -v s="$secs" 'BEGIN { printf "%.1f", s * 1000 }')
  echo "$ms" >> "$work/latencies"
  state=$(workers | head -1 | cut -d' ' -f2)
  [ "$ejected_after" = "-" ] && [ "$state" = ejected ] && ejected_after=$i
  [ "$status" = 200 ] && ok=$((ok + 1))
  [ "$engine" = good ] && good=$((good + 1))
  printf '%-8s %-7s %-10s %12s  %s\n' "$i" "$status" "$engine" "$ms" "$state"
done

sort -n "$work/latencies" > "$work/sorted"
n=$(wc -l < "$work/sorted")
p50=$(sed -n "$(( (n + 1) / 2 ))p" "$work/sorted"); max=$(tail -1 "$work/sorted")
echo
printf '%-34s %s\n' "connect_timeout" "$CONNECT_TIMEOUT" \
  "requests" "$REQUESTS" \
  "p50 / max latency (ms)" "$p50 / $max" \
  "answered 200 / by the good engine" "$ok / $good" \
  "hung engine ejected after request" "$ejected_after" \
  "connections the door held silent" "$(cat "$work/held")"
