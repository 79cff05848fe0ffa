#!/usr/bin/env bash
# Warply's main job on this machine (see README): installs what it needs, then `warply demo`
# builds the local model, runs two real vLLM CPU engines behind warply-router and compares
# strategies on a multi-turn workload from the Mooncake trace.
#   bash scripts/demo.sh [--model tiny|small|DIR] [demo.py options...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_envs.sh core vllm
exec .venvs/core/bin/python -m warply demo --vllm .venvs/vllm/bin/vllm "$@"
