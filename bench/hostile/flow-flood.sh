#!/usr/bin/env bash
# A queue flood (issue 39): one tenant sends 100,000 requests as fast as 256 connections carry
# them at a fleet that is full (a simulated vLLM of 2 ranks running 2 requests each, 20 tokens a
# second), with flow control on, 100 requests waiting per tenant at most and a 5 s wait (the
# defaults are 1,000 and 30 s: 256 connections, each waiting for its answer, would not reach
# them).
# Beside it another tenant sends 20 requests one after another. Prints how the flood was
# answered (503 at once past its cap), the other tenant's answers and latencies, and rankgate's
# RSS before, at its highest (sampled every 0.2 s) and after. Bounded: the flood stops at
# FLOOD requests or 120 s.
set -euo pipefail
cd "$(dirname "$0")/../.."
RANKGATE=${RANKGATE:-target/release/rankgate}
FLOOD=${FLOOD:-100000}
[ -x "$RANKGATE" ] || cargo build --release --locked --bin rankgate >&2
source bench/lib.sh
ulimit -n 65536 2>/dev/null || true

engine=$(free_port); front=$(free_port); admin=$(free_port)
mock_vllm "$engine" "$work/engine.log" --max-num-seqs 2 --decode-rate 20
cat >"$work/rg.toml" <<CONF
[server]
listen = "127.0.0.1:$front"
admin_listen = "127.0.0.1:$admin"
# One address stands for many flooders here.
max_streams_per_client = 1000000
[[engines]]
url = "http://127.0.0.1:$engine"
flavor = "vllm"
dp_size = 2
[flow]
enabled = true
max_running = 2
max_queued_per_tenant = 100
max_wait = "5s"
CONF
serve_rankgate "$work/rg.toml" "$work/rg.log" "$admin"
pid=${pids[-1]}
# Both ranks polled: flow control judges them from their telemetry.
for _ in $(seq 100); do
  [ "$(curl -s "127.0.0.1:$admin/workers" | grep -o '"telemetry":"available"' | wc -l)" = 2 ] && break
  sleep 0.1
done

cat >"$work/flood.py" <<'PY'
import asyncio, json, sys, time
port, pid, total = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

def rss_mb():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0

def request(tenant, max_tokens):
    body = json.dumps({"model": "tiny-llama", "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "hello there"}]}).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: rankgate\r\ncontent-type: application/json\r\n"
            f"x-gateway-inference-fairness-id: {tenant}\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body

async def exchange(reader, writer, req):
    writer.write(req)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    body = await reader.readexactly(length)
    return status, body

statuses, codes, sent = {}, {}, [0]
stop_at = time.monotonic() + 120

async def flooder():
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    req = request("flood", 16)
    while sent[0] < total and time.monotonic() < stop_at:
        sent[0] += 1
        try:
            left = max(0.1, stop_at - time.monotonic())
            status, body = await asyncio.wait_for(exchange(reader, writer, req), left)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            statuses["broken"] = statuses.get("broken", 0) + 1
            continue
        statuses[status] = statuses.get(status, 0) + 1
        if status == 503:
            code = json.loads(body)["error"]["code"]
            codes[code] = codes.get(code, 0) + 1
    writer.close()

async def victim(out):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(20):
        t0 = time.monotonic()
        status, _ = await exchange(reader, writer, request("victim", 2))
        out.append((status, time.monotonic() - t0))

async def sample(peak, done):
    while not done.is_set():
        peak[0] = max(peak[0], rss_mb())
        await asyncio.sleep(0.2)

async def main():
    before = rss_mb()
    peak, done, victims = [before], asyncio.Event(), []
    sampler = asyncio.create_task(sample(peak, done))
    t0 = time.monotonic()
    floods = [asyncio.create_task(flooder()) for _ in range(256)]
    await asyncio.sleep(2)  # the queue is full of the flood by now
    await victim(victims)
    await asyncio.gather(*floods)
    took = time.monotonic() - t0
    done.set(); await sampler
    await asyncio.sleep(5)
    after = rss_mb()
    lat = sorted(t for _, t in victims)
    print(f"flood: {sent[0]} requests in {took:.1f} s ({sent[0] / took:.0f}/s): {dict(sorted(statuses.items(), key=str))}; 503 codes {codes}")
    print(f"victim: {len(victims)} requests, statuses {sorted(set(s for s, _ in victims))}, latency p50 {lat[len(lat)//2]*1000:.0f} ms, max {lat[-1]*1000:.0f} ms")
    print(f"rankgate RSS: before {before:.1f} MB, peak {peak[0]:.1f} MB, 5 s after {after:.1f} MB")

asyncio.run(main())
PY
python3 "$work/flood.py" "$front" "$pid" "$FLOOD"
curl -s "127.0.0.1:$admin/flows" | python3 -c 'import json, sys; f = json.load(sys.stdin); print("/flows:", json.dumps({"objectives": f["objectives"], "tenants": f["tenants"]}))'
