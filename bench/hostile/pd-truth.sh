#!/usr/bin/env bash
# PD failures tell the truth (issue 38, item 6): vLLM prefill/decode fleets of `rankgate
# mock-engine` servers on loopback, behind the release binary with its access log on.
#   decode-500-alone     one P rank, one D rank answering its first request 500 before any byte:
#                        the client's status and message, P's prefills, the access line's attempts;
#   decode-500-failover  the same with two D ranks: 200, P's prefills, attempts;
#   gone-between         P's answer body comes DELAY s after its head (blocks lent); N clients
#                        leave 0.3 s in: counted and logged per stage, and how long until P holds
#                        no KV (rankgate releases the blocks with a one-token decode; P's lease
#                        is 30 s);
#   gone-decode          D never answers; N clients leave during the decode leg: counted, logged.
# Prints one figures line per case and PASS or FAIL with what was expected.
#
#   bench/hostile/pd-truth.sh           # N=20 clients in the gone-* cases
#   N=50 bench/hostile/pd-truth.sh
#
# Every loop is bounded in count and time; every process started here is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/../.."

RANKGATE=${RANKGATE:-target/release/rankgate}
N=${N:-20}
DELAY=${DELAY:-1}
if [ ! -x "$RANKGATE" ]; then cargo build --release --locked --bin rankgate; fi

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; [ -n "${KEEP:-}" ] || rm -rf "$work"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# Polls `$1` (a command) every 0.1 s until it succeeds, at most $2 seconds.
wait_for() { local i; for ((i = 0; i < $2 * 10; i++)); do if eval "$1" >/dev/null 2>&1; then return 0; fi; sleep 0.1; done; echo "timed out: $1" >&2; return 1; }
# The sum of a metric's series on a /metrics page.
metric() { curl -s "$1/metrics" | awk -v m="$2" 'index($0, m) == 1 { s += $NF } END { printf "%d", s }'; }
# Whether P holds no KV at all (its lent blocks count in its KV usage).
kv_free() { curl -s "$1/metrics" | awk '/^vllm:kv_cache_usage_perc/ { s += $NF; n++ } END { exit !(n > 0 && s == 0) }'; }

failures=0
verdict() { # name, condition (a command), what was expected
  if eval "$2"; then echo "PASS $1: $3"; else echo "FAIL $1: $3"; failures=$((failures + 1)); fi
}

# Starts P (extra args $1) and D (dp $2, extra args $3) and a router over them; sets p_url,
# d_url, front, admin, log.
fleet() {
  local name=$1 p_args=$2 d_dp=$3 d_args=$4
  local pp dp
  pp=$(free_port); dp=$(free_port); front=$(free_port); admin=$(free_port)
  # shellcheck disable=SC2086
  "$RANKGATE" mock-engine --listen "127.0.0.1:$pp" --flavor vllm --dp-size 1 --role prefill $p_args \
    > "$work/$name-p.log" 2>&1 &
  pids+=($!)
  # shellcheck disable=SC2086
  "$RANKGATE" mock-engine --listen "127.0.0.1:$dp" --flavor vllm --dp-size "$d_dp" --role decode $d_args \
    > "$work/$name-d.log" 2>&1 &
  pids+=($!)
  p_url="http://127.0.0.1:$pp"; d_url="http://127.0.0.1:$dp"
  cat > "$work/$name.toml" <<TOML
[server]
listen = "127.0.0.1:$front"
admin_listen = "127.0.0.1:$admin"
access_log = true
[telemetry]
interval = "100ms"
[[engines]]
url = "$p_url"
flavor = "vllm"
dp_size = 1
role = "prefill"
[[engines]]
url = "$d_url"
flavor = "vllm"
dp_size = $d_dp
role = "decode"
TOML
  log="$work/$name-rankgate.log"
  "$RANKGATE" serve --config "$work/$name.toml" > "$log" 2>&1 &
  router=$!
  pids+=($router)
  wait_for "curl -sf http://127.0.0.1:$admin/ready" 30
  wait_for "curl -sf http://127.0.0.1:$front/v1/models | grep -q tiny-llama" 30
}
stop_fleet() { kill "$router" 2>/dev/null || true; for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; pids=(); sleep 0.2; }

body='{"model":"tiny-llama","max_tokens":4,"messages":[{"role":"user","content":"Tell me about routers."}]}'
chat() { # request id; prints "status body"
  curl -s -o "$work/body" -w '%{http_code}' --max-time 15 "http://127.0.0.1:$front/v1/chat/completions" \
    -H 'content-type: application/json' -H "x-request-id: $1" -d "$body"
  printf ' %s' "$(python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); print(v.get("error",{}).get("message","ok"))' "$work/body" 2>/dev/null || echo '?')"
}
field() { grep "request_id=\"$1\"" "$log" | grep -o "$2=[^ ]*" | head -1 | cut -d= -f2; }

echo "case                 status  message                                   P prefills  attempts  prefill_attempts  decode_attempts"
# One chat (request id ID) through a pair whose decode server (D_RANKS ranks) answers its first
# request 500: its status, message and P's prefills (in status, msg, prefills), and its row.
decode_500() { # case id d_ranks
  fleet "$1" "" "$3" "--fail-status 500 --fail-first 1"
  local out; out=$(chat "$2"); status=${out%% *}; msg=${out#* }
  wait_for "grep -q 'request_id=\"$2\"' '$log'" 10
  prefills=$(metric "$p_url" "vllm:request_success_total")
  printf '%-20s %6s  %-40s  %10s  %8s  %16s  %15s\n' "decode-500-$1" "$status" "$msg" "$prefills" \
    "$(field "$2" attempts)" "$(field "$2" prefill_attempts)" "$(field "$2" decode_attempts)"
}

decode_500 alone d500 1
verdict decode-500-alone "[ '$status' = 500 ] && [[ '$msg' == *'decode rank failed: 500'* ]] && [ '$prefills' = 1 ] && [ '$(field d500 attempts)' = 2 ]" \
  "500 'decode rank failed: 500 ...' after one prefill, attempts=2 (prefill 1, decode 1); before: 503 'no rank is reachable now', 2 prefills, attempts=0"
stop_fleet

decode_500 failover over 2
verdict decode-500-failover "[ '$status' = 200 ] && [ '$prefills' = 1 ] && [ '$(field over decode_attempts)' = 2 ]" \
  "200 after one prefill, the same blocks read by the other decode rank (decode_attempts=2)"
stop_fleet

echo
echo "case          clients  abandoned{stage}        logged 499  released{read}  P KV after leaving -> 0 within  P expired leases"
gone() { # case name, number of clients, patience s
  local i clients=()
  for ((i = 0; i < $2; i++)); do
    curl -s -o /dev/null --max-time "$3" "http://127.0.0.1:$front/v1/chat/completions" \
      -H 'content-type: application/json' -H "x-request-id: $1-$i" -d "$long" &
    clients+=($!)
  done
  for c in "${clients[@]}"; do wait "$c" 2>/dev/null || true; done
}
long="{\"model\":\"tiny-llama\",\"max_tokens\":4,\"messages\":[{\"role\":\"user\",\"content\":\"$(printf 'word %.0s' $(seq 1 300))\"}]}"
stages() { curl -s "http://127.0.0.1:$admin/metrics" | awk '/^rankgate_pd_abandoned_total/ { sub(/.*stage="/, ""); sub(/"} /, "="); printf "%s ", $0 }'; }

# gone-between
fleet between "--prefill-answer-delay $DELAY" 1 ""
gone between "$N" 0.3
left=$(date +%s.%N)
cleared=-
for ((i = 0; i < 300; i++)); do
  if kv_free "$p_url"; then cleared=$(python3 -c "import time; print('%.2f s' % (time.time() - $left))"); break; fi
  sleep 0.1
done
wait_for "[ \$(grep -c 'status=499' '$log') -ge $N ]" 10 || true
released=$(metric "http://127.0.0.1:$admin" 'rankgate_pd_released_total{outcome="read"}')
expired=$(metric "$p_url" "vllm:nixl_num_kv_expired_reqs_total")
printf '%-13s %7d  %-22s  %10d  %14s  %31s  %16s\n' gone-between "$N" "$(stages)" "$(grep -c 'status=499' "$log")" \
  "$released" "$cleared" "$expired"
verdict gone-between "[ \$(grep -c 'abandoned=\"between\"' '$log') -eq $N ] && [ '$released' = $N ] && [ '$cleared' != - ]" \
  "every client logged (499, abandoned=between) and counted; P's lent blocks released well before its 30 s lease; before: not logged, not counted, held until the lease"
stop_fleet

# gone-decode
fleet decode "" 1 "--hang-requests"
gone decode "$N" 1
wait_for "[ \$(grep -c 'status=499' '$log') -ge $N ]" 10 || true
printf '%-13s %7d  %-22s  %10d\n' gone-decode "$N" "$(stages)" "$(grep -c 'status=499' "$log")"
verdict gone-decode "[ \$(grep -c 'abandoned=\"decode\"' '$log') -eq $N ]" \
  "every client logged (499, abandoned=decode) and counted; before: neither"
stop_fleet

[ "$failures" -eq 0 ]
