#!/usr/bin/env bash
# Warply's main job on this machine (see README): installs what it needs, builds the tiny local
# model, runs a real vLLM CPU engine and shows its cache state through Warply.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_envs.sh core vllm
MODEL="$(.venvs/vllm/bin/python scripts/tiny_model.py --size tiny | tail -n 1)"
exec .venvs/core/bin/python scripts/demo.py --vllm .venvs/vllm/bin/vllm --model "$MODEL" "$@"
