#!/usr/bin/env bash
# Warply's main job on this machine (see README): installs what it needs, builds the local model,
# runs two real vLLM CPU engines behind warply-router and compares prefix_affinity with
# round_robin on a multi-turn workload from the Mooncake trace.
#   bash scripts/demo.sh [--model small] [demo.py options...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SIZE=tiny
if [[ "${1:-}" == "--model" ]]; then SIZE="$2"; shift 2; fi
bash scripts/setup_envs.sh core vllm
MODEL="$(.venvs/vllm/bin/python scripts/tiny_model.py --size "$SIZE" | tail -n 1)"
exec .venvs/core/bin/python scripts/demo.py --vllm .venvs/vllm/bin/vllm --model "$MODEL" "$@"
