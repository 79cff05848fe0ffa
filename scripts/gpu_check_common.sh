# Shared by scripts/gpu_check_vllm.sh and scripts/gpu_check_sglang.sh (sourced, not run): a log
# folder, the started processes' PIDs, stopping them by process group at exit, and a health wait.
# The caller sets CORE (the core venv's python) first.
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
