#!/usr/bin/env bash
# LoRA adapters through rankgate on REAL vLLM servers (issue 40's acceptance), by hand, never
# from CI: two vLLM 0.32 servers, DP=1 each (one core each), --enable-lora --max-loras 1 and
# VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, adapters made by make_tiny_lora.py; rankgate in front.
# Both cores for about 3 minutes; everything it starts is stopped on exit.
#
#   bench/lora-real.sh          # as bench/real-vllm-lib.sh says (RANKGATE, REAL_VLLM, PORT_BASE)
#
# Checks, each printed PASS or FAIL:
#   static   sql-lora, served statically by server A only: 10 of 10 requests through rankgate
#            answered by A, each with the answer A gives it directly (temperature 0);
#   runtime  chat-lora loaded straight on server B (its /v1/load_lora_adapter, not through
#            rankgate): the first request for it through rankgate answered 200 by B, with B's
#            own answer for it;
#   declared math-lora, declared in [[adapters]] and on no server: 10 requests at once through
#            rankgate; the first loads it (one load, on one server), and all 10 are answered with
#            the answer that server gives it directly;
#   failed   bad-lora, declared with a path that does not exist: answered 502 with vLLM's own
#            words; each server is asked once (two requests, one load each), and a third request
#            is answered at once, with no load.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/real-vllm-lib.sh

BASE="${BASE:-$HOME/.cache/real-vllm}"
LORAS="$BASE/loras"
[ -d "$LORAS/sql-lora" ] && [ -d "$LORAS/chat-lora" ] && [ -d "$LORAS/math-lora" ] ||
  "$BASE/venv/bin/python" "$(dirname "$REAL_VLLM")/make_tiny_lora.py" "$BASE/tiny-llama" "$LORAS" sql-lora chat-lora math-lora

A=$((PB + 11)) B=$((PB + 12)) RG=$((PB + 81)) RG_ADMIN=$((PB + 91))
free_ports $A $B $RG $RG_ADMIN
lora=(--enable-lora --max-lora-rank 8 --max-loras 1)
start a env PORT=$A DP=1 CORES=0 VLLM_PORT=$((PB + 500)) VLLM_ALLOW_RUNTIME_LORA_UPDATING=True \
  "$REAL_VLLM" http "${lora[@]}" --lora-modules "sql-lora=$LORAS/sql-lora"
start b env PORT=$B DP=1 CORES=1 VLLM_PORT=$((PB + 550)) VLLM_ALLOW_RUNTIME_LORA_UPDATING=True \
  "$REAL_VLLM" http "${lora[@]}"
wait_models a $A
wait_models b $B

cat > "$work/rankgate.toml" <<TOML
[server]
listen = "127.0.0.1:$RG"
admin_listen = "127.0.0.1:$RG_ADMIN"
expose_worker = "url"
[[engines]]
url = "http://127.0.0.1:$A"
flavor = "vllm"
dp_size = 1
max_loras = 1
[[engines]]
url = "http://127.0.0.1:$B"
flavor = "vllm"
dp_size = 1
max_loras = 1
[[adapters]]
name = "math-lora"
base = "tiny-llama"
path = "$LORAS/math-lora"
[[adapters]]
name = "bad-lora"
base = "tiny-llama"
path = "$LORAS/no-such-lora"
TOML
start rankgate env RUST_LOG=warn "$RANKGATE" serve --config "$work/rankgate.toml"

python3 - "$A" "$B" "$RG" "$RG_ADMIN" "$LORAS" <<'PY'
import http.client, json, sys, time
A, B, RG, ADMIN, LORAS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]

def call(port, method, path, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request(method, path, json.dumps(body) if body is not None else None,
              {"content-type": "application/json"} if body is not None else {})
    r = c.getresponse()
    return r.status, r.read().decode(), r.getheader("x-rankgate-worker")

def chat(port, model, n):
    body = {"model": model, "temperature": 0, "max_tokens": 12,
            "messages": [{"role": "user", "content": f"question {n}"}]}
    s, text, worker = call(port, "POST", "/v1/chat/completions", body)
    answer = json.loads(text)["choices"][0]["message"]["content"] if s == 200 else text
    return s, answer, worker

# rankgate ready, and both servers' lists read
t0 = time.monotonic()
while True:
    try:
        s, text, _ = call(ADMIN, "GET", "/workers")
        rows = json.loads(text)
        if s == 200 and len(rows) == 2 and all(r.get("models") for r in rows) and all(r["telemetry"] in ("available", "fresh") for r in rows):
            break
    except (OSError, ValueError):
        pass
    if time.monotonic() - t0 > 120:
        sys.exit("rankgate did not see both servers in 120 s")
    time.sleep(1)

ok = True
served_by_a, same = 0, 0
for n in range(10):
    s, answer, worker = chat(RG, "sql-lora", n)
    _, direct, _ = chat(A, "sql-lora", n)
    served_by_a += s == 200 and worker == f"http://127.0.0.1:{A}@0"
    same += s == 200 and answer == direct
print(f"static: sql-lora (server A only): {served_by_a} of 10 answered by A, {same} of 10 with A's own answer")
ok &= served_by_a == 10 and same == 10
_, base, _ = chat(A, "tiny-llama", 0)
_, lora, _ = chat(A, "sql-lora", 0)
print(f"  base model's answer {base!r}; sql-lora's {lora!r}")

s, text, _ = call(B, "POST", "/v1/load_lora_adapter", {"lora_name": "chat-lora", "lora_path": f"{LORAS}/chat-lora"})
print(f"runtime: chat-lora loaded straight on server B: {s} {text.strip()[:60]}")
t = time.monotonic()
s, answer, worker = chat(RG, "chat-lora", 0)
took = (time.monotonic() - t) * 1000
_, direct, _ = chat(B, "chat-lora", 0)
print(f"  its first request through rankgate: {s} from {worker} in {took:.0f} ms, {'the same answer as B gives' if answer == direct else 'a DIFFERENT answer from B: ' + repr(answer)}")
ok &= s == 200 and worker == f"http://127.0.0.1:{B}@0" and answer == direct

import threading
got = [None] * 10
def one(n):
    got[n] = chat(RG, "math-lora", n)
t = time.monotonic()
threads = [threading.Thread(target=one, args=(n,)) for n in range(10)]
for th in threads: th.start()
for th in threads: th.join()
took = (time.monotonic() - t) * 1000
holders = [p for p in (A, B) if "math-lora" in call(p, "GET", "/v1/models")[1]]
print(f"declared: math-lora on no server, 10 requests at once through rankgate: {sum(s == 200 for s, _, _ in got)} of 10 answered 200 in {took:.0f} ms; servers holding it after: {len(holders)}")
same = 0
if len(holders) == 1:
    h = holders[0]
    for n, (s, answer, worker) in enumerate(got):
        _, direct, _ = chat(h, "math-lora", n)
        same += s == 200 and worker == f"http://127.0.0.1:{h}@0" and answer == direct
print(f"  {same} of 10 answered by that server with the answer it gives directly; e.g. {got[0][1]!r}")
ok &= len(holders) == 1 and same == 10
_, page, _ = call(ADMIN, "GET", "/adapters")
print(f"  rankgate's /adapters: {[(s['url'], [a['name'] for a in s['adapters']]) for s in json.loads(page)['servers']]}")

s1, e1, _ = chat(RG, "bad-lora", 0)
s2, e2, _ = chat(RG, "bad-lora", 1)
t = time.monotonic()
s3, e3, _ = chat(RG, "bad-lora", 2)
again = (time.monotonic() - t) * 1000
failed = json.loads(call(ADMIN, "GET", "/adapters")[1])["failed"]
print(f"failed: bad-lora (no such path): {s1} {json.loads(e1)['error']['message']}")
print(f"  the second request: {s2} (the other server tried); the third: {s3} in {again:.0f} ms; servers remembered as failed: {len(failed)}")
ok &= (s1, s2, s3) == (502, 502, 502) and "No adapter found" in e1 and len(failed) == 2
print("PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
