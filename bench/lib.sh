# Shared by the bench/ scripts (sourced from the repository root): a work directory and the
# processes to stop on exit, free loopback ports, a process's CPU ticks, waiting for a URL, a
# simulated vLLM server, a wrk run with the CPU it cost, and the nginx configs they run.

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
mkdir -p "$work/tmp"
cp tests/fixtures/vllm-0.32-dp2-metrics.txt "$work/metrics"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
# Waits (10 s at most) until URL answers 2xx.
wait_http() { for _ in $(seq 100); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done; echo "no answer from $1" >&2; return 1; }
# rankgate serving CONFIG, its log in LOG: started, stopped on exit, waited for until its admin
# listener on 127.0.0.1:ADMIN is ready.
serve_rankgate() { # config log admin
  "$RANKGATE" serve --config "$1" >"$2" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$3/ready"
}
# A simulated vLLM server (DP 2) on 127.0.0.1:PORT, its log in LOG, extra flags after: started,
# stopped on exit, waited for.
mock_vllm() { # port log [flags...]
  local port=$1 log=$2; shift 2
  "$RANKGATE" mock-engine --listen "127.0.0.1:$port" --flavor vllm --dp-size 2 "$@" >"$log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$port/health"
}

# wrk's latency percentile ("50%" or "99%") in milliseconds (it prints us, ms or s).
wrk_ms() {
  awk -v q="$1" '$1 == q { v = $2; f = 1
    if (v ~ /us$/) f = 0.001; else if (v ~ /ms$/) f = 1; else if (v ~ /s$/) f = 1000
    sub(/[a-z]+$/, "", v); print v * f }' "$work/out"
}

# Runs the script's own `load TARGET DURATION` (its wrk command) while counting the CPU ticks of
# PID; prints "req/s,ticks,requests,p50 ms,p99 ms,error-lines".
measure_wrk() { # target pid duration
  local c0 c1
  c0=$(cpu_ticks "$2"); load "$1" "$3" > "$work/out"; c1=$(cpu_ticks "$2")
  printf '%s,%s,%s,%s,%s,%s\n' "$(awk '/Requests\/sec/ {print $2}' "$work/out")" "$((c1 - c0))" \
    "$(awk '/requests in/ {print $1}' "$work/out")" "$(wrk_ms 50%)" "$(wrk_ms 99%)" \
    "$(grep -cE 'Non-2xx|Socket errors' "$work/out" || true)"
}

# The fake engines, one nginx worker: a fixed chat-completion answer and a real vLLM DP=2
# /metrics capture, at $1 (model tiny-llama) and $2 (model other-model).
upstream_conf() {
  cat <<CONF
worker_processes 1; daemon off; pid $work/up.pid; error_log $work/up.err;
events { worker_connections 8192; }
http {
  access_log off; client_body_temp_path $work/tmp;
  server { listen 127.0.0.1:$1; keepalive_requests 10000000;
    location = /metrics { default_type text/plain; alias $work/metrics; }
    location = /v1/models { default_type application/json; return 200 '{"object":"list","data":[{"id":"tiny-llama","object":"model"}]}'; }
    location / { default_type application/json; return 200 '{"id":"cmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}]}'; }
  }
  server { listen 127.0.0.1:$2; keepalive_requests 10000000;
    location = /metrics { default_type text/plain; alias $work/metrics; }
    location = /v1/models { default_type application/json; return 200 '{"object":"list","data":[{"id":"other-model","object":"model"}]}'; }
    location / { default_type application/json; return 200 '{"id":"cmpl-2","object":"chat.completion","choices":[]}'; }
  }
}
CONF
}

# nginx as a reverse proxy with $1 workers, listening on $2, to the engine at $3.
proxy_conf() {
  cat <<CONF
worker_processes $1; daemon off; pid $work/px.pid; error_log $work/px.err;
events { worker_connections 8192; }
http {
  access_log off; client_body_temp_path $work/tmp; proxy_temp_path $work/tmp;
  upstream engine { server 127.0.0.1:$3; keepalive 256; }
  server { listen 127.0.0.1:$2; keepalive_requests 10000000;
    location / { proxy_pass http://engine; proxy_http_version 1.1; proxy_set_header Connection ""; }
  }
}
CONF
}
