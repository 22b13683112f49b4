#!/usr/bin/env bash
# A body that drips: one byte every 2 s of a 1,000-byte chat body, each gap well under the
# per-read deadline (body_read_timeout = 5s), against rankgate with body_timeout = 10s, and, where
# nginx is installed, against nginx proxying to the same engine with client_body_timeout 5s
# (nginx bounds the gap between reads only). Prints when each server answered (or closed) and
# with what; every drip stops at 30 s.
set -euo pipefail
cd "$(dirname "$0")/../.."
RANKGATE=${RANKGATE:-target/release/rankgate}
[ -x "$RANKGATE" ] || cargo build --release --locked --bin rankgate >&2
# The work directory, the processes stopped on exit, free_port.
source bench/lib.sh

engine=$(free_port); front=$(free_port); admin=$(free_port)
mock_vllm "$engine" "$work/engine.log"
cat >"$work/rg.toml" <<CONF
[server]
listen = "127.0.0.1:$front"
admin_listen = "127.0.0.1:$admin"
body_read_timeout = "5s"
body_timeout = "10s"
[[engines]]
url = "http://127.0.0.1:$engine"
flavor = "vllm"
dp_size = 2
CONF
serve_rankgate "$work/rg.toml" "$work/rg.log" "$admin"

cat >"$work/drip.py" <<'PY'
import socket, sys, time
port = int(sys.argv[1])
s = socket.create_connection(("127.0.0.1", port))
s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
s.settimeout(2.0)
t0 = time.time()
sent, answer = 0, b""
while time.time() - t0 < 30 and sent < 1000:
    try:
        s.sendall(b" ")
        sent += 1
    except OSError:
        break
    try:
        data = s.recv(4096)
        answer = data or b"(closed)"
        break
    except socket.timeout:
        pass
    except OSError:
        answer = b"(reset)"
        break
took = time.time() - t0
line = answer.split(b"\r\n")[0].decode(errors="replace") if answer else "(still open at 30 s)"
print(f"{took:.1f} s|{sent} bytes|{line}")
PY

row() { # server port
  IFS='|' read -r took sent line < <(python3 "$work/drip.py" "$2")
  printf '| %s | %s | %s | %s |\n' "$1" "$took" "$sent" "$line"
}
echo "| server | ended after | body bytes sent | answer |"
echo "|---|---|---|---|"
row "rankgate (body_read_timeout 5s, body_timeout 10s)" "$front"
if command -v nginx >/dev/null; then
  nx=$(free_port)
  mkdir -p "$work/tmp"
  cat >"$work/nginx.conf" <<CONF
worker_processes 1; daemon off; pid $work/nginx.pid; error_log $work/nginx.err;
events { worker_connections 64; }
http {
  access_log off; client_body_temp_path $work/tmp; proxy_temp_path $work/tmp;
  client_body_timeout 5s;
  server { listen 127.0.0.1:$nx; location / { proxy_pass http://127.0.0.1:$engine; } }
}
CONF
  nginx -c "$work/nginx.conf" &
  pids+=($!)
  wait_http "http://127.0.0.1:$nx/health"
  row "nginx (client_body_timeout 5s)" "$nx"
else
  echo "| nginx | not installed: skipped | | |"
fi
