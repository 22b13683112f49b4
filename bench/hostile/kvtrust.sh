#!/usr/bin/env bash
# Hostile publishers on a KV-event endpoint rankgate binds (issue 30, items 9-11), on loopback
# only. A `rankgate mock-engine` at 127.0.0.1 publishes its KV events to an endpoint the router
# binds (tcp://127.0.0.1:PORT, as vLLM does with a concrete host); then, one attack at a time,
# N connections (python3 stdlib threads):
#   stranger-31MiB  from 127.0.0.2 (not the engine's address): a ZMTP greeting, a frame header
#                   announcing 31 MiB, then up to 31 MiB - 1 of it, held open;
#   engine-31MiB    the same from the engine's own address, 127.0.0.1;
#   engine-1MiB     from 127.0.0.1, frames just under the 1 MiB cap, stalled one byte short;
# and prints the router's resident memory before and at its peak during each attack, what it
# refused (/metrics), and whether a chat request through the front door was answered meanwhile.
#
#   bench/hostile/kvtrust.sh            # 256 connections per attack
#   CONNS=64 HOLD=4 bench/hostile/kvtrust.sh
#
# Every loop is bounded in count and time; every process started here is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/../.."

RANKGATE=${RANKGATE:-target/release/rankgate}
CONNS=${CONNS:-256}     # connections per attack
HOLD=${HOLD:-8}         # seconds each attacking connection is held open at most
if [ ! -x "$RANKGATE" ]; then cargo build --release; fi

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; [ -n "${KEEP:-}" ] || rm -rf "$work"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
rss_kb() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
# Polls `$1` (a command) every 0.1 s until it succeeds, at most $2 seconds.
wait_for() { local i; for ((i = 0; i < $2 * 10; i++)); do if eval "$1" >/dev/null 2>&1; then return 0; fi; sleep 0.1; done; echo "timed out: $1" >&2; return 1; }

engine_port=$(free_port); kv_port=$(free_port); front=$(free_port); admin=$(free_port)
"$RANKGATE" mock-engine --listen "127.0.0.1:$engine_port" --flavor vllm --dp-size 1 \
  --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:$kv_port\",\"topic\":\"kv\"}" \
  > "$work/engine.log" 2>&1 &
pids+=($!)
cat > "$work/rankgate.toml" <<TOML
[server]
listen = "127.0.0.1:$front"
admin_listen = "127.0.0.1:$admin"
[telemetry]
interval = "100ms"
[routing]
prefix_affinity = true
kv_events = true
[[models]]
name = "tiny-llama"
tokenizer = "$PWD/tests/fixtures/vllm-0.32-kv-events"
[[engines]]
url = "http://127.0.0.1:$engine_port"
flavor = "vllm"
dp_size = 1
TOML
"$RANKGATE" serve --config "$work/rankgate.toml" > "$work/rankgate.log" 2>&1 &
router=$!
pids+=($router)
wait_for "curl -sf http://127.0.0.1:$admin/workers | grep -q '\"telemetry\": *\"available\"'" 30
chat() {
  curl -s -o /dev/null -w '%{http_code} %{time_total}' --max-time 10 "http://127.0.0.1:$front/v1/chat/completions" \
    -H 'content-type: application/json' \
    -d '{"model":"tiny-llama","max_tokens":4,"messages":[{"role":"user","content":"Tell me about routers, at length please."}]}'
}
kv_state() { curl -s "http://127.0.0.1:$admin/workers" | python3 -c 'import json,sys; w=json.load(sys.stdin)[0]["kv_index"]; print(w["state"], "messages=%s" % w["messages"])'; }
# The engine's publisher connects (it retries with a backoff; what it publishes before is
# dropped, as ZeroMQ drops it), then publishes its first message (sequence 0) once it serves.
wait_for "[ \$(ss -Htn state established '( sport = :$kv_port )' | wc -l) -ge 1 ]" 30
echo "work: $work" >&2
wait_for "chat >/dev/null; kv_state | grep -q '^available'" 30

cat > "$work/attack.py" <<'PY'
import socket, struct, sys, threading, time
src, port, conns, announce, send, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
greeting = b"\xff" + b"\0" * 8 + b"\x7f\x03\x01NULL" + b"\0" * 16 + b"\0" + b"\0" * 31
props = bytes([11]) + b"Socket-Type" + struct.pack(">I", 3) + b"PUB"
ready = bytes([5]) + b"READY" + props
ready = bytes([0x04, len(ready)]) + ready
head = bytes([0x01, 2]) + b"kv" + bytes([0x01, 8]) + b"\0" * 8 + bytes([0x02]) + struct.pack(">Q", announce)
stop = time.time() + hold
def one():
    try:
        s = socket.socket(); s.settimeout(hold); s.bind((src, 0)); s.connect(("127.0.0.1", port))
        s.sendall(greeting + ready + head)
        chunk, left = b"\0" * 65536, send
        while left > 0 and time.time() < stop:
            n = s.send(chunk[:min(left, len(chunk))]); left -= n
        while time.time() < stop:
            if not s.recv(4096): break
    except OSError:
        pass
threads = [threading.Thread(target=one, daemon=True) for _ in range(conns)]
for t in threads: t.start()
for t in threads: t.join(hold + 5)
PY

refused() { curl -s "http://127.0.0.1:$admin/metrics" | awk '/^rankgate_kv_publishers_refused_total/ {sub(/.*reason="/, ""); sub(/"} /, "="); printf "%s ", $0}'; }

printf '%-15s %6s %10s %10s %10s %-22s %s\n' attack conns rss_before rss_peak delta front_door "refused_total (cumulative)"
for attack in stranger-31MiB engine-31MiB engine-1MiB; do
  case $attack in
    stranger-31MiB) src=127.0.0.2; announce=$((31 << 20)); send=$(((31 << 20) - 1)) ;;
    engine-31MiB) src=127.0.0.1; announce=$((31 << 20)); send=$(((31 << 20) - 1)) ;;
    engine-1MiB) src=127.0.0.1; announce=$(((1 << 20) - 16)); send=$(((1 << 20) - 17)) ;;
  esac
  before=$(rss_kb "$router"); peak=$before
  python3 "$work/attack.py" "$src" "$kv_port" "$CONNS" "$announce" "$send" "$HOLD" &
  attacker=$!
  pids+=($attacker)
  sleep 1
  answered=$(chat)
  for ((i = 0; i < (HOLD + 6) * 10; i++)); do
    r=$(rss_kb "$router"); [ "$r" -gt "$peak" ] && peak=$r
    kill -0 "$attacker" 2>/dev/null || break
    sleep 0.1
  done
  wait "$attacker" 2>/dev/null || true
  printf '%-15s %6d %8d MB %8d MB %8d MB %-22s %s\n' "$attack" "$CONNS" $((before / 1024)) $((peak / 1024)) \
    $(((peak - before) / 1024)) "$answered s" "$(refused)"
done
echo "engine's rank after the attacks: $(kv_state)"
