# Shared by the bench/ scripts that run REAL vLLM engines (pd-real.sh, fresh-real.sh; sourced from
# the repository root): the rankgate binary (built when absent), the launcher, the port base and its
# checks, a work directory, and the engines and routers started, each in its own process group and
# stopped on exit (SIGTERM, up to 60 s, then SIGKILL to the group: vLLM's engine-core and DP children).
#
# Environment: RANKGATE (default target/release/rankgate), REAL_VLLM (default
# ../shared/tools/real-vllm/run-real-vllm.sh), PORT_BASE (19000: every port is PORT_BASE + 0..999,
# below 32768), START_TIMEOUT (seconds a vLLM may take to answer /v1/models, 600), KEEP_WORK.

RANKGATE="${RANKGATE:-target/release/rankgate}"
REAL_VLLM="${REAL_VLLM:-../shared/tools/real-vllm/run-real-vllm.sh}"
PB="${PORT_BASE:-19000}"
START_TIMEOUT="${START_TIMEOUT:-600}"

[ -x "$REAL_VLLM" ] || { echo "no real-vllm launcher at $REAL_VLLM" >&2; exit 1; }
if [ ! -x "$RANKGATE" ]; then
  [ "$RANKGATE" = target/release/rankgate ] || { echo "RANKGATE=$RANKGATE is not executable" >&2; exit 1; }
  cargo build --release
fi
[ "$PB" -ge 1024 ] && [ "$((PB + 999))" -lt 32768 ] || { echo "PORT_BASE must keep ports in 1024..32767" >&2; exit 1; }

free_ports() { # every port given must be free to listen on
  local p
  for p in "$@"; do
    if ss -Hltn "sport = :$p" | grep -q .; then echo "port $p is taken: set PORT_BASE" >&2; exit 1; fi
  done
}

work=$(mktemp -d)
declare -A procs=()   # name -> pid (each started in its own process group)
stop() { # name: SIGTERM, wait up to 60 s, then SIGKILL what is left of its process group
  local name=$1 pid=${procs[$1]:-}
  [ -n "$pid" ] || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then echo "# $name ($pid) ignored SIGTERM for 60 s: SIGKILL" >&2; fi
  kill -KILL -- "-$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  unset "procs[$name]"
}
cleanup() {
  local n
  for n in rankgate "${!procs[@]}"; do stop "$n"; done
  [ -n "${KEEP_WORK:-}" ] && echo "# work directory kept: $work" >&2 || rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start() { # name, then the command (appends to $work/name.log)
  local name=$1; shift
  setsid "$@" >> "$work/$name.log" 2>&1 &
  procs[$name]=$!
}

wait_models() { # name, port: until GET /v1/models answers, bounded
  local name=$1 port=$2 t0=$SECONDS
  while ! python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
      "http://127.0.0.1:$port/v1/models" 2> /dev/null; do
    if ! kill -0 "${procs[$name]}" 2>/dev/null; then
      echo "# $name exited while starting; its log:" >&2; tail -30 "$work/$name.log" >&2; exit 1
    fi
    if [ $((SECONDS - t0)) -ge "$START_TIMEOUT" ]; then
      echo "# $name not up within ${START_TIMEOUT}s; its log:" >&2; tail -30 "$work/$name.log" >&2; exit 1
    fi
    sleep 2
  done
  echo "# $name up on :$port after $((SECONDS - t0)) s"
}
