#!/usr/bin/env bash
# Hostile engines and strangers' claims, part "engine-answers": what an engine answers is
# untrusted input, and so is what a client says of its own address.
#
#   1. A vLLM prefill server whose kv_transfer_params name remote_host 6.6.6.6 (mock-engine
#      --role prefill --side-host 6.6.6.6) before a decode server: 20 chats; their statuses, the
#      decode's requests (its vllm:request_success_total), rankgate's bad_params count, /workers.
#   2. An engine (python3 stdlib) answering with Server, Via, Alt-Svc, Set-Cookie, X-Powered-By,
#      X-Served-By, its rank (x-sim-rank, x-data-parallel-rank), then with a 32 KB and a 200 KB
#      header: which reach the client, rankgate with default settings; nginx 1.22 beside it
#      (proxy_pass defaults) where installed.
#   3. X-Real-IP, True-Client-IP, X-Client-IP, CF-Connecting-IP, X-Original-Forwarded-For from a
#      stranger (127.0.0.1) and from a trusted proxy (127.0.0.2, server.trusted_proxies): which
#      the engine received.
#   4. POST /reload with the config path made a link to /proc/self/environ (rankgate's own
#      environment, its admin token in it) and a file with a secret on line 3: the answer and
#      the log, searched for the token and the secret.
#
# Prints PASS/FAIL lines and the figures. Every wait is bounded; every process started is
# stopped on exit. Needs python3 and curl.
# Usage: bench/hostile/engine-answers.sh   (RANKGATE=path/to/rankgate to use another build)
set -euo pipefail
cd "$(dirname "$0")/../.."
RANKGATE=${RANKGATE:-target/release/rankgate}
if [[ ! -x "$RANKGATE" ]]; then
  cargo build --release --quiet
fi
for t in python3 curl; do
  command -v "$t" >/dev/null || { echo "needs $t" >&2; exit 2; }
done

# The work directory, the processes stopped on exit, free_port.
. bench/lib.sh
failed=0
verdict() { # ok?, what
  if [[ "$1" == 1 ]]; then echo "PASS $2"; else echo "FAIL $2"; failed=1; fi
}

# Polls URL until it answers 200: at most 100 tries, 0.1 s apart.
wait_ok() {
  for _ in $(seq 100); do
    curl -fs -o /dev/null --max-time 1 "$1" && return 0
    sleep 0.1
  done
  echo "no answer from $1" >&2; exit 1
}

# Polls /workers (admin port $1) until $2 ranks are available (bounded as above).
wait_available() {
  for _ in $(seq 100); do
    if curl -fs --max-time 1 "http://127.0.0.1:$1/workers" |
      python3 -c 'import json,sys; w=json.load(sys.stdin); sys.exit(0 if len(w)==int(sys.argv[1]) and all(r["telemetry"] in ("available", "fresh") for r in w) else 1)' "$2"; then
      return 0
    fi
    sleep 0.1
  done
  echo "ranks not available behind admin port $1" >&2; exit 1
}

# A rankgate with `$2` ([server] lines) and `$3` ([[engines]] tables), `$4` ranks awaited.
# Sets `front` and `admin`; its log is $work/$1.log.
router() { # name, server lines, engine tables, ranks
  front=$(free_port); admin=$(free_port)
  printf '[server]\nlisten = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\n%s\n[telemetry]\ninterval = "250ms"\nstale_after = "60s"\n%s\n' \
    "$front" "$admin" "$2" "$3" > "$work/$1.toml"
  "$RANKGATE" serve --config "$work/$1.toml" > "$work/$1.log" 2>&1 &
  pids+=($!)
  wait_ok "http://127.0.0.1:$admin/ready"
  wait_available "$admin" "$4"
}

CHAT='{"model":"tiny-llama","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'

echo "== 1. a prefill server naming remote_host 6.6.6.6"
P=$(free_port); D=$(free_port)
"$RANKGATE" mock-engine --listen "127.0.0.1:$P" --flavor vllm --dp-size 1 --role prefill --side-host 6.6.6.6 > "$work/p.log" 2>&1 &
pids+=($!)
"$RANKGATE" mock-engine --listen "127.0.0.1:$D" --flavor vllm --dp-size 1 --role decode > "$work/d.log" 2>&1 &
pids+=($!)
wait_ok "http://127.0.0.1:$P/health"; wait_ok "http://127.0.0.1:$D/health"
router pd "" "$(printf '[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "vllm"\ndp_size = 1\nrole = "prefill"\n[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "vllm"\ndp_size = 1\nrole = "decode"\n' "$P" "$D")" 2
: > "$work/statuses"
for _ in $(seq 20); do
  curl -s --max-time 10 -o "$work/b" -w '%{http_code}\n' -H 'content-type: application/json' \
    -d "$CHAT" "http://127.0.0.1:$front/v1/chat/completions" >> "$work/statuses" || echo 000 >> "$work/statuses"
done
statuses=$(sort "$work/statuses" | uniq -c | awk '{printf "%s x %s, ", $1, $2}')
message=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["error"]["message"])' "$work/b" 2>/dev/null || head -c 200 "$work/b")
decoded=$(curl -s --max-time 5 "http://127.0.0.1:$D/metrics" | awk '/^vllm:request_success_total/ {s+=$2} END {print s+0}')
bad=$(curl -s --max-time 5 "http://127.0.0.1:$admin/metrics" | awk -F' ' '/^rankgate_pd_failures_total\{leg="prefill",kind="bad_params"\}/ {print $2}')
pd=$(curl -s --max-time 5 "http://127.0.0.1:$admin/workers" | python3 -c 'import json,sys
for w in json.load(sys.stdin):
    if w.get("role") == "prefill" or "prefill" in json.dumps(w.get("pd", "")) or w["engine"].endswith(sys.argv[1]):
        print(w["pd"]["state"], w["pd"].get("kind", "-")); break' "$P")
echo "statuses: ${statuses%, }"
echo "client told: $message"
echo "decode's requests (vllm:request_success_total): $decoded"
echo "rankgate_pd_failures_total{kind=bad_params}: ${bad:-none}; prefill rank in /workers: $pd"
verdict "$([[ $(grep -c '^502$' "$work/statuses") == 20 ]] && echo 1)" "every chat answered 502"
verdict "$([[ "$decoded" == 0 ]] && echo 1)" "the decode never received the parameters"
verdict "$(grep -q '6.6.6.6' "$work/b" || echo 1)" "the 502 names no address"
verdict "$([[ "$pd" == "failing bad_params" ]] && echo 1)" "the prefill rank is judged failing (bad_params)"
verdict "$(grep -q 'remote_host' "$work/pd.log" && grep -q '6.6.6.6' "$work/pd.log" && echo 1)" "the operator's log names the host refused"

echo
echo "== 2. an engine that names itself, and one header of 32 KB / 200 KB"
E=$(free_port)
cat > "$work/engine.py" <<'PY'
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
metrics = open(sys.argv[2], "rb").read()
NAMING = [("Server", "vllm-engine/10.77.0.9:8000"), ("Via", "1.1 gpu-node-7.internal"),
          ("Alt-Svc", 'h2="gpu-node-7.internal:8443"'), ("Set-Cookie", "node=gpu-node-7; Path=/"),
          ("X-Powered-By", "vllm 10.77.0.9"), ("X-Served-By", "gpu-node-7"),
          ("x-sim-rank", "1"), ("x-data-parallel-rank", "1")]
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def version_string(self):
        return "vllm-engine/10.77.0.9:8000"
    def reply(self, ctype, body, extra=()):
        self.send_response(200)
        for k, v in extra:
            self.send_header(k, v)
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
        extra = list(NAMING[1:])
        huge = int(self.headers.get("x-test-huge-header") or 0)
        if huge:
            extra.append(("x-huge", "h" * huge))
        self.reply("application/json", json.dumps({"seen": seen}).encode(), extra)
    def log_message(self, *a):
        pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
PY
python3 "$work/engine.py" "$E" tests/fixtures/vllm-0.32-dp2-metrics.txt > "$work/engine.log" 2>&1 &
pids+=($!)
wait_ok "http://127.0.0.1:$E/health"
router names "trusted_proxies = [\"127.0.0.2/32\"]" "$(printf '[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "vllm"\ndp_size = 2\ntelemetry = ["prometheus"]\n' "$E")" 2
names_front=$front

nginx_front=""
if command -v nginx >/dev/null; then
  nginx_front=$(free_port)
  mkdir -p "$work/nginx"
  cat > "$work/nginx/nginx.conf" <<NGX
worker_processes 1;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log;
events { worker_connections 64; }
http {
  access_log off;
  client_body_temp_path $work/nginx; proxy_temp_path $work/nginx; fastcgi_temp_path $work/nginx;
  uwsgi_temp_path $work/nginx; scgi_temp_path $work/nginx;
  server { listen 127.0.0.1:$nginx_front; location / { proxy_pass http://127.0.0.1:$E; } }
}
NGX
  nginx -c "$work/nginx/nginx.conf" -p "$work/nginx" 2>/dev/null || nginx_front=""
  [[ -n "$nginx_front" ]] && pids+=("$(cat "$work/nginx/nginx.pid" 2>/dev/null || echo 0)")
fi

ask() { # port, more curl args -> status; headers in $work/h
  curl -s --max-time 10 -D "$work/h" -o "$work/b" -w '%{http_code}' -H 'content-type: application/json' \
    "${@:2}" -d "$CHAT" "http://127.0.0.1:$1/v1/chat/completions" || echo 000
}
reached() { # header name -> yes/no in $work/h
  if grep -qi "^$1:" "$work/h"; then echo "yes: $(grep -i "^$1:" "$work/h" | head -1 | cut -d' ' -f2- | tr -d '\r' | cut -c1-34)"; else echo no; fi
}
ask "$names_front" > /dev/null; cp "$work/h" "$work/h.rankgate"
if [[ -n "$nginx_front" ]]; then ask "$nginx_front" > /dev/null; cp "$work/h" "$work/h.nginx"; fi
printf '%-22s %-44s %s\n' "engine header" "reaches the client via rankgate (default)" "via nginx 1.22 (proxy_pass defaults)"
leaked=0
for h in server via alt-svc set-cookie x-powered-by x-served-by x-sim-rank x-data-parallel-rank; do
  cp "$work/h.rankgate" "$work/h"; r=$(reached "$h")
  [[ "$r" == no ]] || leaked=1
  n="-"; if [[ -n "$nginx_front" ]]; then cp "$work/h.nginx" "$work/h"; n=$(reached "$h"); fi
  printf '%-22s %-44s %s\n' "$h" "$r" "$n"
done
verdict "$([[ $leaked == 0 ]] && echo 1)" "no engine-naming header reaches a client under expose_worker = \"none\""
for size in 32768 204800; do
  s=$(ask "$names_front" -H "x-test-huge-header: $size")
  got=$({ grep -i '^x-huge:' "$work/h" || true; } | tr -d '\r' | cut -d' ' -f2- | wc -c)
  n="-"; if [[ -n "$nginx_front" ]]; then n=$(ask "$nginx_front" -H "x-test-huge-header: $size"); fi
  echo "engine header of $size bytes: rankgate $s (x-huge passed: $(( got > 1 ? got - 1 : 0 )) bytes); nginx $n"
done
verdict "$([[ $(ask "$names_front" -H 'x-test-huge-header: 204800') == 502 ]] && echo 1)" "a 200 KB engine header is a 502, never passed on"
sleep 0.3
cause=$({ grep -o 'message head is too large' "$work/names.log" || true; } | head -1)
verdict "$([[ -n "$cause" ]] && echo 1)" "the log names the cause (${cause:-nothing found})"

echo
echo "== 3. client-IP headers, from a stranger (127.0.0.1) and a trusted proxy (127.0.0.2)"
claims=(-H 'x-real-ip: 203.0.113.7' -H 'true-client-ip: 203.0.113.7' -H 'x-client-ip: 203.0.113.7'
  -H 'cf-connecting-ip: 203.0.113.7' -H 'x-original-forwarded-for: 203.0.113.7')
ask "$names_front" "${claims[@]}" > /dev/null; cp "$work/b" "$work/stranger.json"
ask "$names_front" --interface 127.0.0.2 "${claims[@]}" > /dev/null; cp "$work/b" "$work/proxy.json"
python3 - "$work/stranger.json" "$work/proxy.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["seen"]; p = json.load(open(sys.argv[2]))["seen"]
names = ["x-real-ip", "true-client-ip", "x-client-ip", "cf-connecting-ip", "x-original-forwarded-for"]
print("%-26s %-24s %s" % ("header", "engine got (stranger)", "engine got (trusted proxy)"))
for n in names:
    print("%-26s %-24s %s" % (n, s.get(n, "(removed)"), p.get(n, "(removed)")))
print("%-26s %-24s %s" % ("x-forwarded-for", s.get("x-forwarded-for"), p.get("x-forwarded-for")))
ok = all(n not in s for n in names) and all(p.get(n) == "203.0.113.7" for n in names)
print(("PASS" if ok else "FAIL") + " client-IP headers reach the engine from a trusted proxy only")
sys.exit(0 if ok else 1)
PY
[[ $? == 0 ]] || failed=1

echo
echo "== 4. a reload of /proc/self/environ and of a file with a secret on line 3"
export RANKGATE_BENCH_ADMIN_TOKEN=bench-admin-token-5f1c9e
E2=$(free_port)
"$RANKGATE" mock-engine --listen "127.0.0.1:$E2" --flavor vllm --dp-size 1 > "$work/e2.log" 2>&1 &
pids+=($!)
wait_ok "http://127.0.0.1:$E2/health"
router reload 'admin_token_env = "RANKGATE_BENCH_ADMIN_TOKEN"' "$(printf '[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "vllm"\ndp_size = 1\n' "$E2")" 1
rm "$work/reload.toml"; ln -s /proc/self/environ "$work/reload.toml"
code=$(curl -s --max-time 10 -o "$work/b" -w '%{http_code}' -X POST -H "authorization: Bearer $RANKGATE_BENCH_ADMIN_TOKEN" "http://127.0.0.1:$admin/reload")
echo "environ: $code $(head -c 300 "$work/b")"
verdict "$([[ $code == 400 ]] && ! grep -q "$RANKGATE_BENCH_ADMIN_TOKEN" "$work/b" && ! grep -q "$RANKGATE_BENCH_ADMIN_TOKEN" "$work/reload.log" && echo 1)" "the environment's admin token is in neither the 400 nor the log"
rm "$work/reload.toml"
printf '[server]\nlisten = "127.0.0.1:1"\nadmin_token = sk-live-0123456789abcdef\n' > "$work/reload.toml"
code=$(curl -s --max-time 10 -o "$work/b" -w '%{http_code}' -X POST -H "authorization: Bearer $RANKGATE_BENCH_ADMIN_TOKEN" "http://127.0.0.1:$admin/reload")
echo "secret on line 3: $code $(head -c 300 "$work/b")"
verdict "$([[ $code == 400 ]] && grep -q 'line 3' "$work/b" && ! grep -q 'sk-live' "$work/b" "$work/reload.log" && echo 1)" "the line is named, the secret is in neither the 400 nor the log"
exit $failed
