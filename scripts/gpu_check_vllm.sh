#!/usr/bin/env bash
# GPU check for vLLM P/D behind warply-router. Needs one CUDA GPU and a Python environment with
# vLLM's CUDA build, NIXL (`pip install nixl`) and this checkout installed (`pip install -e .
# --no-deps`, which registers the WarplyConnector plugin); the CPU-only dev machine cannot run
# it. Takes 3-5 minutes (8 at most: the script stops itself); everything binds 127.0.0.1 and is
# stopped by PID (process group). What tests/vllm/test_pd_router.py does on CPU, on the GPU:
#  1. one plain engine records greedy reference answers (scripts/gpu_pd_check.py record);
#  2. a prefill (kv_producer) and a decode (kv_consumer) engine, each with the WarplyConnector
#     wrapping NixlConnector (KV in GPU memory), behind warply-router (.venvs/core) with
#     prefill / decode pools handing every prompt off; every answer must equal phase 1's and be
#     handed off (scripts/gpu_pd_check.py check); the router's P/D stats are printed.
# Usage: VLLM_PY=/path/to/cuda-venv/bin/python bash scripts/gpu_check_vllm.sh [MODEL_DIR]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/script_help.sh" "$@"  # --help: the comment above
if [[ -z "${WARPLY_GPU_CHECK_TIMED:-}" ]]; then
  WARPLY_GPU_CHECK_TIMED=1 exec timeout 480 bash "$0" "$@"
fi
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VLLM_PY="${VLLM_PY:-python3}"
CORE="$ROOT/.venvs/core/bin/python"
MODEL="${1:-$ROOT/.cache/tiny-small}"
BLOCK=16 REF_PORT=30200 P_PORT=30201 D_PORT=30202 R_PORT=30203
P_EVENTS=5610 P_REPLAY=5611 D_EVENTS=5612 D_REPLAY=5613 P_SIDE=5620 D_SIDE=5621
export PYTHONPATH="$ROOT"
"$VLLM_PY" - <<'PY' || exit 1
import importlib.metadata as md
import sys
import nixl, torch, vllm  # noqa: F401
if not torch.cuda.is_available():
    sys.exit("this vLLM environment sees no CUDA GPU (the CPU build cannot run this check)")
if "warply" not in {ep.name for ep in md.entry_points(group="vllm.general_plugins")}:
    sys.exit("the Warply plugin is not installed here: pip install -e <checkout> --no-deps")
PY
[[ -d "$MODEL" ]] || "$VLLM_PY" "$ROOT/scripts/tiny_model.py" --size small --out "$MODEL"
# shellcheck source=scripts/gpu_check_common.sh
source "$ROOT/scripts/gpu_check_common.sh"
vllm() {  # vllm LOG PORT ARGS...: start an engine in its own process group, PID in $!
  local log="$1" port="$2"; shift 2
  setsid "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --served-model-name tiny --host 127.0.0.1 --port "$port" --block-size "$BLOCK" \
    --max-model-len 2048 --gpu-memory-utilization 0.3 --enforce-eager --seed 0 \
    --enable-prefix-caching --enable-prompt-tokens-details "$@" >"$log" 2>&1 &
}
connector() {  # connector ROLE EVENTS REPLAY WORKER: the --kv-transfer-config JSON
  printf '{"kv_connector":"WarplyConnector","kv_role":"%s","kv_load_failure_policy":"recompute",' "$1"
  printf '"kv_connector_extra_config":{"delegate":{"kv_connector":"NixlConnector",'
  printf '"kv_buffer_device":"cuda"},"warply":{"events_endpoint":"tcp://127.0.0.1:%s",' "$2"
  printf '"replay_endpoint":"tcp://127.0.0.1:%s","worker":"%s"}}}' "$3" "$4"
}

echo "== phase 1: reference answers from one plain engine"
vllm "$LOGS/reference.log" "$REF_PORT"
REF=$!
PIDS+=("$REF")
healthy "http://127.0.0.1:$REF_PORT" "$REF" "$LOGS/reference.log"
"$CORE" "$ROOT/scripts/gpu_pd_check.py" record "http://127.0.0.1:$REF_PORT" "$LOGS/reference.json" tiny
stop "$REF"

echo "== phase 2: WarplyConnector over NixlConnector, prefill + decode behind warply-router"
VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT=$P_SIDE \
  vllm "$LOGS/prefill.log" "$P_PORT" \
  --kv-transfer-config "$(connector kv_producer "$P_EVENTS" "$P_REPLAY" p)"
PIDS+=("$!")
VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT=$D_SIDE \
  vllm "$LOGS/decode.log" "$D_PORT" \
  --kv-transfer-config "$(connector kv_consumer "$D_EVENTS" "$D_REPLAY" d)"
PIDS+=("$!")
cat >"$LOGS/router.yaml" <<YAML
model: tiny
tokenizer: $MODEL
host: 127.0.0.1
port: $R_PORT
pd: {local_prefill_tokens: 0, prefill_timeout_s: 60}
pools:
  - name: prefill
    role: prefill
    block_size: $BLOCK
    workers:
      - {name: p, url: "http://127.0.0.1:$P_PORT", bind: true,
         events: "tcp://127.0.0.1:$P_EVENTS", replay: "tcp://127.0.0.1:$P_REPLAY"}
  - name: decode
    role: decode
    block_size: $BLOCK
    workers:
      - {name: d, url: "http://127.0.0.1:$D_PORT", bind: true,
         events: "tcp://127.0.0.1:$D_EVENTS", replay: "tcp://127.0.0.1:$D_REPLAY"}
YAML
route_and_check vLLM
