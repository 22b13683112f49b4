#!/usr/bin/env bash
# Fresh DP ranks on REAL vLLM engines (issue 37's acceptance), by hand, never from CI: it starts real
# vLLM 0.32 engines with ../shared/tools/real-vllm (set up once with its `setup`), takes both cores for
# 5-15 minutes, and stops everything it started on exit.
#
#   bench/fresh-real.sh [whole|pd|both]    # RANKGATE=path/to/rankgate to use a binary already built
#
# A vLLM with --data-parallel-size 2 and one API server per rank (its default) publishes no
# kv_cache_usage_perc / num_requests_* for a rank until that rank has served a request; its counters
# are there from the start, at 0. Nothing is sent to an engine directly: rankgate starts beside the
# fresh engines, and 20 requests go through it, 12 one at a time, then 8 at once. Each request's
# rank is read from rankgate's access log (`worker`, and `prefill_worker` for a disaggregated one).
# Passes when every rank (each side's, for the P/D pair) took requests and rank 0's first request is
# among the first 4.
#
# whole: one vLLM DP=2 (cores 0|1). pd: a prefill DP=2 and a decode DP=2 (NixlConnector), each on
# cores 0|1. Environment: as bench/real-vllm-lib.sh says (RANKGATE, REAL_VLLM, PORT_BASE, START_TIMEOUT).
set -euo pipefail
cd "$(dirname "$0")/.."

WHAT="${1:-both}"
# The decode server's DP size: 2, or 1 (core 1) where a DP=2 decode beside a DP=2 prefill does not
# start on two cores (its DP coordinator timed out after 120 s here, four engine cores on two CPUs).
D_DP="${D_DP:-2}"
. bench/real-vllm-lib.sh

E_PORT=$((PB + 5)) P_PORT=$((PB + 10)) D_PORT=$((PB + 40)) RG_PORT=$((PB + 80)) RG_ADMIN=$((PB + 90))
P_SIDE=$((PB + 110)) D_SIDE=$((PB + 140)) P_VLLM=$((PB + 200)) D_VLLM=$((PB + 300)) E_VLLM=$((PB + 400))
free_ports $E_PORT $P_PORT $D_PORT $RG_PORT $RG_ADMIN $P_SIDE $((P_SIDE + 1)) $D_SIDE $((D_SIDE + 1))

start_rankgate() { # the [[engines]] entries, then more config
  printf '[server]\nlisten = "127.0.0.1:%s"\nadmin_listen = "127.0.0.1:%s"\naccess_log = true\n\n%s\n%s\n' \
    "$RG_PORT" "$RG_ADMIN" "${2:-}" "$1" > "$work/rankgate.toml"
  : > "$work/rankgate.log"
  start rankgate env RUST_LOG=info "$RANKGATE" serve --config "$work/rankgate.toml" --log-format json
  local t0=$SECONDS
  until python3 "$work/fresh.py" ready 2> /dev/null; do
    kill -0 "${procs[rankgate]}" 2>/dev/null || { tail -20 "$work/rankgate.log" >&2; exit 1; }
    [ $((SECONDS - t0)) -lt 60 ] || { echo "# rankgate: no rank routable in 60 s" >&2; python3 "$work/fresh.py" state; exit 1; }
    sleep 1
  done
}

export RG_PORT RG_ADMIN WORK="$work"
cat > "$work/fresh.py" <<'PY'
import http.client, json, os, sys, threading, time, uuid

RG, ADMIN, WORK = int(os.environ["RG_PORT"]), int(os.environ["RG_ADMIN"]), os.environ["WORK"]
NONCE = uuid.uuid4().hex[:8]

def call(port, method, path, body=None, headers=None, timeout=300):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"content-type": "application/json"} if body is not None else {}
    h.update(headers or {})
    c.request(method, path, None if body is None else json.dumps(body), h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data

def workers():
    return [w for w in json.loads(call(ADMIN, "GET", "/workers", timeout=10)[1]) if w.get("dp_rank") is not None]

def state(prefix="#   "):
    for w in workers():
        print(f"{prefix}{w['id']} ({w.get('role')}): telemetry {w.get('telemetry')}"
              + (f" {w['fresh']}" if w.get("fresh") else "")
              + (f" ({w['reason']})" if w.get("reason") else "")
              + f", kv_usage {w.get('kv_usage')}, in_flight {w.get('in_flight')}")

def access(rid, wait=10.0):
    deadline = time.time() + wait
    while time.time() < deadline:
        with open(os.path.join(WORK, "rankgate.log")) as f:
            for line in f:
                if rid in line and '"rankgate::access"' in line:
                    return json.loads(line)
        time.sleep(0.1)
    return {}

def one(i, out):
    rid = f"fresh-{NONCE}-{i}"
    body = {"model": "tiny-llama", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": f"request {i} of run {NONCE}: name three rivers"}]}
    t0 = time.time()
    try:
        s, raw = call(RG, "POST", "/v1/chat/completions", body, {"x-request-id": rid})
    except Exception as e:
        s, raw = type(e).__name__, b""
    log = access(rid)
    out[i] = {"status": s, "worker": log.get("worker"), "prefill": log.get("prefill_worker"),
              "took": time.time() - t0, "raw": raw[:200].decode(errors="replace") if s != 200 else ""}

def rank(w):
    w = str(w or "")
    return int(w.rsplit("@", 1)[1]) if "@" in w else None

def run(pd):
    print("# rankgate's view of the fresh fleet before any request:")
    state()
    out = {}
    for i in range(12):
        one(i, out)
    threads = [threading.Thread(target=one, args=(i, out)) for i in range(12, 20)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    sides = [("prefill", "prefill"), ("decode", "worker")] if pd else [("whole", "worker")]
    ok = all(out[i]["status"] == 200 for i in out)
    for i in sorted(out):
        r = out[i]
        print(f"{i:>3} {'one at a time' if i < 12 else '8 at once':<14}{r['status']:>5}  "
              + "  ".join(f"{name}=@{rank(r[key])}" for name, key in sides)
              + f"  took={r['took']:.1f}s" + (f"  {r['raw']}" if r["raw"] else ""))
    for name, key in sides:
        ranks = [rank(out[i][key]) for i in sorted(out)]
        per = {r: ranks.count(r) for r in sorted(set(x for x in ranks if x is not None))}
        first0 = ranks.index(0) + 1 if 0 in ranks else None
        good = set(per) == {0, 1} and first0 is not None and first0 <= 4
        ok &= good
        print(f"# {name}: requests per rank {per}; rank 0's first request: #{first0}: {'PASS' if good else 'FAIL'}")
    print("# rankgate's view afterwards:")
    state()
    return ok

if __name__ == "__main__":
    if sys.argv[1] == "ready":
        ws = workers()
        sys.exit(0 if ws and all(w.get("telemetry") in ("available", "fresh") for w in ws) else 1)
    if sys.argv[1] == "state":
        state()
        sys.exit(0)
    sys.exit(0 if run(sys.argv[1] == "pd") else 1)
PY

rc=0
if [ "$WHAT" = whole ] || [ "$WHAT" = both ]; then
  echo "## Whole engine: vLLM DP=2 (cores 0|1, :$E_PORT), started fresh"
  start engine env PORT=$E_PORT DP=2 CORES="0|1" VLLM_PORT=$E_VLLM "$REAL_VLLM" http
  wait_models engine $E_PORT
  start_rankgate "$(printf '[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "vllm"\n' $E_PORT)"
  python3 "$work/fresh.py" whole || rc=1
  stop rankgate; stop engine
fi
if [ "$WHAT" = pd ] || [ "$WHAT" = both ]; then
  echo "## Prefill DP=2 + decode DP=$D_DP (NixlConnector, each on cores 0|1, :$P_PORT and :$D_PORT), started fresh"
  start prefill env PORT=$P_PORT DP=2 CORES="0|1" SIDE_PORT=$P_SIDE VLLM_PORT=$P_VLLM UCX_PORTS="$((PB + 700))-$((PB + 749))" \
    ENGINE_ID=fresh-P "$REAL_VLLM" prefill
  wait_models prefill $P_PORT
  start decode env PORT=$D_PORT DP=$D_DP CORES="$([ "$D_DP" = 1 ] && echo 1 || echo '0|1')" SIDE_PORT=$D_SIDE VLLM_PORT=$D_VLLM UCX_PORTS="$((PB + 750))-$((PB + 799))" \
    ENGINE_ID=fresh-D "$REAL_VLLM" decode
  wait_models decode $D_PORT
  # Four engine cores on two CPUs: a real vLLM's /metrics and /health took over 2 s to answer here
  # (the default telemetry timeout), so this fleet is polled with more patience.
  start_rankgate "$(printf '[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "vllm"\nrole = "prefill"\n\n[[engines]]\nurl = "http://127.0.0.1:%s"\nflavor = "vllm"\nrole = "decode"\n' $P_PORT $D_PORT)" \
    "$(printf '[telemetry]\ntimeout = "8s"\nstale_after = "20s"\n')"
  python3 "$work/fresh.py" pd || rc=1
fi
echo "# fresh-real: $([ $rc = 0 ] && echo PASS || echo FAIL)"
exit $rc
