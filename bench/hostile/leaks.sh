#!/usr/bin/env bash
# Hostile client, part "leaks": what a stranger learns of the fleet from rankgate's default
# answers, and whether a Connection header can strip what rankgate forwards.
#
# Starts (loopback only) mock engines, a header-echoing engine (python3 stdlib) and one rankgate
# per case with the default settings, then asks with curl:
#   200  a healthy engine          504  an engine that never answers (response_timeout = 1s)
#   502  an engine killed after its last poll (slow polls: it still looks fine)
# and prints, for each, whether the answer names the engine (x-rankgate-worker, its address
# anywhere in headers or body) or a setting. Then sends `Connection: X-Forwarded-For,
# X-Forwarded-Proto, X-Request-Id, Content-Type` with a forged X-Forwarded-For and prints what
# the engine received next to what the client was told.
#
# Needs python3 and curl. Every wait is bounded; every process started is stopped on exit.
# Usage: bench/hostile/leaks.sh        (RANKGATE=path/to/rankgate to use another build)
set -euo pipefail
cd "$(dirname "$0")/../.."
RANKGATE=${RANKGATE:-target/release/rankgate}
if [[ ! -x "$RANKGATE" ]]; then
  cargo build --release --quiet
fi
for t in python3 curl; do
  command -v "$t" >/dev/null || { echo "needs $t" >&2; exit 2; }
done

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Polls URL until it answers 200: at most 100 tries, 0.1 s apart.
wait_ok() {
  for _ in $(seq 100); do
    curl -fs -o /dev/null --max-time 1 "$1" && return 0
    sleep 0.1
  done
  echo "no answer from $1" >&2; exit 1
}

# Polls the router's /workers (admin port $1) until every rank is available (bounded as above).
wait_available() {
  for _ in $(seq 100); do
    if curl -fs --max-time 1 "http://127.0.0.1:$1/workers" |
      python3 -c 'import json,sys; w=json.load(sys.stdin); sys.exit(0 if w and all(r["telemetry"]=="available" for r in w) else 1)'; then
      return 0
    fi
    sleep 0.1
  done
  echo "ranks not available behind admin port $1" >&2; exit 1
}

mock() { # port, more mock-engine flags
  local port=$1; shift
  "$RANKGATE" mock-engine --listen "127.0.0.1:$port" --flavor vllm --dp-size 2 "$@" \
    > "$work/mock-$port.log" 2>&1 &
  pids+=($!)
  wait_ok "http://127.0.0.1:$port/health"
}

# A rankgate with default settings (plus `$3`, [server] lines) before the engine at port $2;
# `$4`: the [telemetry] interval. Sets `front` and `admin`.
router() { # name, engine port, server lines, poll interval
  front=$(free_port); admin=$(free_port)
  cat > "$work/$1.toml" <<CONF
[server]
listen = "127.0.0.1:$front"
admin_listen = "127.0.0.1:$admin"
$3
[telemetry]
interval = "$4"
stale_after = "60s"
[[engines]]
url = "http://127.0.0.1:$2"
flavor = "vllm"
dp_size = 2
CONF
  "$RANKGATE" serve --config "$work/$1.toml" > "$work/$1.log" 2>&1 &
  pids+=($!)
  wait_ok "http://127.0.0.1:$admin/ready"
  wait_available "$admin"
}

CHAT='{"model":"tiny-llama","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
ask() { # front port -> headers in $work/h, body in $work/b, status printed
  curl -s --max-time 10 -D "$work/h" -o "$work/b" -w '%{http_code}' \
    -H 'content-type: application/json' -d "$CHAT" "http://127.0.0.1:$1/v1/chat/completions" || true
}

row() { # case, status, engine port
  local worker named setting msg
  worker=$(grep -i '^x-rankgate-worker:' "$work/h" | cut -d' ' -f2- | tr -d '\r' || true)
  named=no; grep -q "127.0.0.1:$3" "$work/h" "$work/b" && named=YES
  setting=no; grep -qE '(server|routing|telemetry)\.[a-z_]+' "$work/h" "$work/b" && setting=YES
  msg=$(python3 -c 'import json,sys
try: print(json.load(open(sys.argv[1]))["error"]["message"][:60])
except Exception: print("-")' "$work/b")
  printf '%-6s %-6s %-22s %-14s %-9s %s\n' "$1" "$2" "${worker:-(none)}" "$named" "$setting" "$msg"
}

echo "== default answers (server.expose_worker unset)"
printf '%-6s %-6s %-22s %-14s %-9s %s\n' case status x-rankgate-worker "engine address" setting message
good=$(free_port); mock "$good"
router ok "$good" "" "250ms"
row 200 "$(ask "$front")" "$good"

hung=$(free_port); mock "$hung" --hang-requests
router slow "$hung" 'response_timeout = "1s"' "250ms"
row 504 "$(ask "$front")" "$hung"

doomed=$(free_port); mock "$doomed"
doomed_pid=${pids[-1]}
router dead "$doomed" "" "30s"
kill "$doomed_pid"
for _ in $(seq 50); do curl -s -o /dev/null --max-time 1 "http://127.0.0.1:$doomed/health" || break; sleep 0.1; done
row 502 "$(ask "$front")" "$doomed"

echo
echo "== Connection: X-Forwarded-For, X-Forwarded-Proto, X-Request-Id, Content-Type (with a forged X-Forwarded-For: 6.6.6.6)"
# An engine that answers a vLLM DP=2 /metrics and echoes every other request's headers.
echo_port=$(free_port)
cat > "$work/echo.py" <<'PY'
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
metrics = open(sys.argv[2], "rb").read()
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def reply(self, ctype, body):
        self.send_response(200)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/metrics":
            return self.reply("text/plain; version=0.0.4", metrics)
        if self.path == "/v1/models":
            return self.reply("application/json", b'{"object":"list","data":[{"id":"tiny-llama","object":"model"}]}')
        self.reply("text/plain", b"")
    def do_POST(self):
        n = int(self.headers.get("content-length") or 0)
        self.rfile.read(n)
        seen = {k.lower(): v for k, v in self.headers.items()}
        self.reply("application/json", json.dumps({"seen": seen}).encode())
    def log_message(self, *a):
        pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
PY
python3 "$work/echo.py" "$echo_port" tests/fixtures/vllm-0.32-dp2-metrics.txt > "$work/echo.log" 2>&1 &
pids+=($!)
wait_ok "http://127.0.0.1:$echo_port/health"
router echo "$echo_port" "" "250ms"
printf '%-16s %-12s %-12s %-18s %-20s %s\n' request "engine XFF" "engine XFP" "engine x-request-id" "client x-request-id" "engine content-type"
for connection in "" "X-Forwarded-For, X-Forwarded-Proto, X-Request-Id, Content-Type"; do
  label=${connection:+with Connection}
  curl -s --max-time 10 -D "$work/h" -o "$work/b" -H 'content-type: application/json' \
    -H 'x-request-id: client-id-1' -H 'x-forwarded-for: 6.6.6.6' -H 'x-forwarded-proto: https' \
    ${connection:+-H "connection: $connection"} -d "$CHAT" "http://127.0.0.1:$front/v1/chat/completions" > /dev/null
  told=$(grep -i '^x-request-id:' "$work/h" | cut -d' ' -f2- | tr -d '\r')
  python3 -c 'import json,sys
s=json.load(open(sys.argv[1]))["seen"]
print("%-16s %-12s %-12s %-18s %-20s %s" % (sys.argv[2], s.get("x-forwarded-for","(none)"), s.get("x-forwarded-proto","(none)"), s.get("x-request-id","(none)")[:18], sys.argv[3][:20], s.get("content-type","(none)")))' \
    "$work/b" "${label:-plain}" "$told" 2>/dev/null || echo "echo engine answered: $(head -c 200 "$work/b")"
done
