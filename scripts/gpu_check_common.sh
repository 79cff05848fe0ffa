# Shared by scripts/gpu_check_vllm.sh and scripts/gpu_check_sglang.sh (sourced, not run): a log
# folder, the started processes' PIDs, stopping them by process group at exit, and a health wait.
# The caller sets CORE (the core venv's python) and ROOT first.
LOGS="$(mktemp -d)"
PIDS=()
stop() {  # each process runs in its own process group (setsid): stop the group by its PID
  for pid in "$@"; do kill -- "-$pid" 2>/dev/null || true; done
  for pid in "$@"; do wait "$pid" 2>/dev/null || true; done
}
trap 'stop "${PIDS[@]}"; echo "logs in $LOGS"' EXIT
trap 'exit 143' TERM INT
healthy() {  # healthy URL PID LOG: wait for URL/health while PID lives; else LOG's tail
  for _ in $(seq 300); do
    "$CORE" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
      "$1/health" 2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || break
    sleep 1
  done
  echo "$1 did not become healthy; $3:" >&2; tail -20 "$3" >&2; return 1
}
route_and_check() {  # route_and_check ENGINE: start the router on $LOGS/router.yaml (the
  # caller's prefill and decode engines are PIDS[1] and PIDS[2], on $P_PORT and $D_PORT; the
  # router's port is $R_PORT), wait for all three, send the P/D check through it against
  # $LOGS/reference.json and print the router's P/D stats
  setsid "$CORE" -m router --config "$LOGS/router.yaml" >"$LOGS/router.log" 2>&1 &
  PIDS+=("$!")
  healthy "http://127.0.0.1:$P_PORT" "${PIDS[1]}" "$LOGS/prefill.log"
  healthy "http://127.0.0.1:$D_PORT" "${PIDS[2]}" "$LOGS/decode.log"
  healthy "http://127.0.0.1:$R_PORT" "${PIDS[3]}" "$LOGS/router.log"
  sleep 3  # the router's first health probe marks the workers healthy
  "$CORE" "$ROOT/scripts/gpu_pd_check.py" check "http://127.0.0.1:$R_PORT" "$LOGS/reference.json" tiny
  "$CORE" -c 'import json, sys, urllib.request
s = json.load(urllib.request.urlopen(sys.argv[1]))
print("router pd stats:", json.dumps(s.get("pd"))[:400])' "http://127.0.0.1:$R_PORT/warply/cache_stats"
  echo "$1 GPU check passed"
}
