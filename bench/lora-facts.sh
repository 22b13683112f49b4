#!/usr/bin/env bash
# Captures what a REAL vLLM 0.32 answers about LoRA adapters (issue 40), by hand, never from CI:
# one DP=1 server with runtime adapter updating on, --max-loras 1 and one static adapter, then
# runtime loads and unloads (good, repeated, bad path, unknown), the model list, each adapter's
# answer, and `vllm:lora_requests_info` while two adapters compete for the one slot. Writes each
# exchange to OUT (default tests/fixtures/vllm-0.32-lora/), status line first. Both cores for
# about 2 minutes; everything it starts is stopped on exit.
#
#   bench/lora-facts.sh          # OUT=dir, and as bench/real-vllm-lib.sh says
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-tests/fixtures/vllm-0.32-lora}"
. bench/real-vllm-lib.sh

BASE="${BASE:-$HOME/.cache/real-vllm}"
LORAS="$BASE/loras"
[ -d "$LORAS/sql-lora" ] && [ -d "$LORAS/chat-lora" ] ||
  "$BASE/venv/bin/python" "$(dirname "$REAL_VLLM")/make_tiny_lora.py" "$BASE/tiny-llama" "$LORAS" sql-lora chat-lora

E_PORT=$((PB + 7)) E_VLLM=$((PB + 450))
free_ports $E_PORT
start engine env PORT=$E_PORT DP=1 VLLM_PORT=$E_VLLM VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "$REAL_VLLM" http \
  --enable-lora --max-lora-rank 8 --max-loras 1 --lora-modules "sql-lora=$LORAS/sql-lora"
wait_models engine $E_PORT
mkdir -p "$OUT"

ask() { # file, method, path, [json body]: the status line, then the body
  python3 - "$E_PORT" "$@" <<'PY'
import http.client, sys
port, name, method, path = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
body = sys.argv[5] if len(sys.argv) > 5 else None
c = http.client.HTTPConnection("127.0.0.1", int(port), timeout=120)
c.request(method, path, body, {"content-type": "application/json"} if body else {})
r = c.getresponse()
data = r.read().decode()
with open(name, "w") as f:
    f.write(f"HTTP {r.status} {r.reason}\ncontent-type: {r.getheader('content-type')}\n\n{data}\n")
print(f"# {name}: {r.status}")
PY
}
chat() { echo "{\"model\":\"$1\",\"messages\":[{\"role\":\"user\",\"content\":\"say something\"}],\"max_tokens\":8,\"temperature\":0}"; }
lora_info() { python3 -c 'import sys, urllib.request; print("\n".join(l for l in urllib.request.urlopen(sys.argv[1]).read().decode().splitlines() if "lora" in l))' "http://127.0.0.1:$E_PORT/metrics" > "$1"; echo "# $1"; }

ask "$OUT/models-static.txt" GET /v1/models
lora_info "$OUT/metrics-lora-start.txt"
ask "$OUT/chat-base.txt" POST /v1/chat/completions "$(chat tiny-llama)"
ask "$OUT/chat-sql-lora.txt" POST /v1/chat/completions "$(chat sql-lora)"
ask "$OUT/chat-chat-lora-before-load.txt" POST /v1/chat/completions "$(chat chat-lora)"
ask "$OUT/load-ok.txt" POST /v1/load_lora_adapter "{\"lora_name\":\"chat-lora\",\"lora_path\":\"$LORAS/chat-lora\"}"
ask "$OUT/load-again.txt" POST /v1/load_lora_adapter "{\"lora_name\":\"chat-lora\",\"lora_path\":\"$LORAS/chat-lora\"}"
ask "$OUT/load-bad-path.txt" POST /v1/load_lora_adapter "{\"lora_name\":\"nowhere-lora\",\"lora_path\":\"/nonexistent/lora\"}"
ask "$OUT/load-no-path.txt" POST /v1/load_lora_adapter '{"lora_name":"half"}'
ask "$OUT/models-after-load.txt" GET /v1/models
ask "$OUT/chat-chat-lora.txt" POST /v1/chat/completions "$(chat chat-lora)"
lora_info "$OUT/metrics-lora-after-two.txt"
# Two adapters at once over one slot: the second waits while the first runs.
python3 - "$E_PORT" "$OUT/metrics-lora-competing.txt" <<'PY'
import http.client, json, sys, threading, time, urllib.request
port, out = int(sys.argv[1]), sys.argv[2]
def one(model):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/chat/completions", json.dumps({"model": model, "max_tokens": 200, "ignore_eos": True,
              "messages": [{"role": "user", "content": "go on"}]}), {"content-type": "application/json"})
    c.getresponse().read()
ts = [threading.Thread(target=one, args=(m,)) for m in ("sql-lora", "chat-lora", "sql-lora", "chat-lora")]
for t in ts: t.start()
time.sleep(1.0)
m = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
open(out, "w").write("\n".join(l for l in m.splitlines() if "lora" in l or "num_requests" in l) + "\n")
for t in ts: t.join()
print(f"# {out}")
PY
ask "$OUT/unload-ok.txt" POST /v1/unload_lora_adapter '{"lora_name":"chat-lora"}'
ask "$OUT/unload-unknown.txt" POST /v1/unload_lora_adapter '{"lora_name":"chat-lora"}'
ask "$OUT/models-after-unload.txt" GET /v1/models
lora_info "$OUT/metrics-lora-end.txt"
echo "# written to $OUT"
