#!/usr/bin/env bash
# Clients that stop reading: FLOOD streaming chats (max_tokens TOKENS) from 127.0.0.1, each on a
# socket with a 4 KB receive buffer (SO_RCVBUF 4096) that never reads, held HOLD seconds, against
# rankgate with default settings (send_timeout 60 s, max_streams_per_client 256, one address at
# most half of an engine's 1,024 connection slots) before one `rankgate mock-engine` (DP 2, the
# default deployment's rates), and, where nginx is installed, against nginx proxying to a second
# engine with send_timeout 60s and proxy_buffering off (as SSE is proxied). Meanwhile a good
# client from 127.0.0.2 asks for a short chat (max_tokens 8, new connection) every second.
#
# Printed: every 5 s, the requests in flight at the proxy (rankgate_rank_in_flight_requests),
# the engine's running and waiting requests and its KV usage (mean of its ranks), the streams
# rankgate cut for send_timeout and its 429s; then the good client's latencies while the flood
# held on (p50/p99/max, and how many got no answer in 15 s).
#
# Needs python3 (nginx for the comparison: apt-get install nginx-light). Loopback only; every
# loop bounded; every process stopped on exit.
# Usage: bench/hostile/stop-reading.sh [FLOOD=1100] [HOLD=90] [TOKENS=4000]
set -euo pipefail
cd "$(dirname "$0")/../.."
FLOOD=${1:-1100}
HOLD=${2:-90}
TOKENS=${3:-4000}
command -v python3 >/dev/null || { echo "needs python3" >&2; exit 2; }
TARGET_DIR=${CARGO_TARGET_DIR:-target}
RANKGATE=${RANKGATE:-$TARGET_DIR/release/rankgate}
[ -x "$RANKGATE" ] || cargo build --release --locked --quiet --bin rankgate
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
# The work directory, the processes stopped on exit, free_port.
source bench/lib.sh

cat >"$work/flood.py" <<'PY'
# flood.py FRONT ENGINE_METRICS PROXY_METRICS(or -) FLOOD HOLD TOKENS
import json, socket, sys, threading, time, urllib.request
front, engine_metrics, proxy_metrics = int(sys.argv[1]), sys.argv[2], sys.argv[3]
flood, hold, tokens = int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])

def request(stream, max_tokens):
    body = json.dumps({"model": "tiny-llama", "stream": stream, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "tell me a long story"}]}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body

def scrape(url):
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except Exception:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out

def total(m, prefix, contains=""):
    return sum(v for k, v in m.items() if k.startswith(prefix) and contains in k)

socks, start = [], time.time()
req = request(True, tokens)
for i in range(flood):
    if time.time() - start > 30:
        break
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.bind(("127.0.0.1", 0))
    s.settimeout(5)
    try:
        s.connect(("127.0.0.1", front))
        s.sendall(req)
    except OSError:
        s.close()
        continue
    socks.append(s)
t0 = time.time()
print(f"flood: {len(socks)} of {flood} streams sent in {t0 - start:.1f} s, none read from now on")

good, stop = [], threading.Event()
def good_client():
    short = request(False, 8)
    while not stop.is_set():
        began = time.time()
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        s.settimeout(15)
        status = "none"
        try:
            s.connect(("127.0.0.1", front))
            s.sendall(short)
            got = b""
            while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < int(
                    [l.split(b":")[1] for l in got.split(b"\r\n\r\n")[0].split(b"\r\n")
                     if l.lower().startswith(b"content-length:")][0] or 0):
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
            status = got.split(b" ", 2)[1].decode() if got else "closed"
        except (OSError, IndexError, ValueError):
            pass
        finally:
            s.close()
        good.append((time.time() - began, status))
        stop.wait(max(0.0, 1.0 - (time.time() - began)))
thread = threading.Thread(target=good_client, daemon=True)
thread.start()

print("| t (s) | in flight at the proxy | engine running | engine waiting | engine KV | cut (send_timeout) | 429s |")
print("|---|---|---|---|---|---|---|")
while time.time() - t0 < hold:
    e = scrape(engine_metrics)
    p = scrape(proxy_metrics) if proxy_metrics != "-" else {}
    ranks = [v for k, v in e.items() if k.startswith("vllm:kv_cache_usage_perc")]
    kv = 100 * sum(ranks) / len(ranks) if ranks else float("nan")
    flight = total(p, "rankgate_rank_in_flight_requests") if p else float("nan")
    cut = total(p, "rankgate_streams_cut_total", 'reason="send_timeout"') if p else float("nan")
    r429 = total(p, "rankgate_local_responses_total", 'status="429"') if p else float("nan")
    print(f"| {time.time() - t0:.0f} | {flight:.0f} | {total(e, 'vllm:num_requests_running'):.0f} | "
          f"{total(e, 'vllm:num_requests_waiting'):.0f} | {kv:.1f}% | {cut:.0f} | {r429:.0f} |", flush=True)
    time.sleep(max(0.0, 5 - (time.time() - t0) % 5))
stop.set()
thread.join(timeout=20)
for s in socks:
    s.close()
lat = sorted(t for t, st in good if st == "200")
bad = [st for t, st in good if st != "200"]
def pct(q):
    return f"{1000 * lat[min(len(lat) - 1, int(q * len(lat)))]:.0f} ms" if lat else "-"
print(f"good client (127.0.0.2): {len(good)} requests, {len(lat)} answered 200, "
      f"p50 {pct(0.5)}, p99 {pct(0.99)}, max {pct(1.0)}; not 200: {len(bad)} {sorted(set(bad))}")
PY

run() { # title front engine-metrics proxy-metrics
  echo "### $1"
  echo
  timeout $((HOLD + 120)) python3 "$work/flood.py" "$2" "$3" "$4" "$FLOOD" "$HOLD" "$TOKENS"
  echo
}

engine=$(free_port); front=$(free_port); admin=$(free_port)
mock_vllm "$engine" "$work/engine.log"
cat >"$work/rg.toml" <<CONF
[server]
listen = "127.0.0.1:$front"
admin_listen = "127.0.0.1:$admin"
[[engines]]
url = "http://127.0.0.1:$engine"
flavor = "vllm"
dp_size = 2
CONF
serve_rankgate "$work/rg.toml" "$work/rg.log" "$admin"
run "rankgate (defaults: send_timeout 60 s, max_streams_per_client 256)" "$front" \
  "http://127.0.0.1:$engine/metrics" "http://127.0.0.1:$admin/metrics"

if command -v nginx >/dev/null; then
  engine2=$(free_port); nx=$(free_port)
  mock_vllm "$engine2" "$work/engine2.log"
  cat >"$work/nginx.conf" <<CONF
worker_processes 1; daemon off; pid $work/nginx.pid; error_log $work/nginx.err;
worker_rlimit_nofile 8192;
events { worker_connections 4096; }
http {
  access_log off; client_body_temp_path $work/tmp; proxy_temp_path $work/tmp;
  send_timeout 60s; proxy_read_timeout 600s;
  server { listen 127.0.0.1:$nx;
    location / { proxy_pass http://127.0.0.1:$engine2; proxy_buffering off; proxy_http_version 1.1; }
  }
}
CONF
  nginx -c "$work/nginx.conf" -p "$work" 2>/dev/null &
  pids+=($!)
  for _ in $(seq 50); do curl -s -o /dev/null "http://127.0.0.1:$nx/health" && break; sleep 0.1; done
  run "nginx (send_timeout 60s, proxy_buffering off, no limit per address)" "$nx" \
    "http://127.0.0.1:$engine2/metrics" "-"
else
  echo "(nginx not installed: no comparison)"
fi
