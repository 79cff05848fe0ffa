#!/usr/bin/env bash
# Warply's main job on this machine (see README): installs what it needs, builds the local model
# and runs the SDK's example (examples/quickstart.py): two vLLM CPU engines with an LMCache cpu
# tier behind the Warply router, up → two tenants' conversations from the shipped Mooncake
# workload through the OpenAI client → cache_stats() → down.
#   bash scripts/demo.sh [--model small] [quickstart.py options...]
# (`.venvs/core/bin/python examples/quickstart.py --help` lists those options)
# The strategy comparison (adaptive / prefix_affinity / round_robin on two engines):
#   .venvs/core/bin/python -m warply demo --vllm .venvs/vllm/bin/vllm
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/script_help.sh" "$@"  # --help: the comment above
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SIZE=tiny
if [[ "${1:-}" == "--model" ]]; then
    [[ $# -ge 2 ]] || { echo "scripts/demo.sh: --model needs tiny, small or a model folder" >&2; exit 2; }
    SIZE="$2"
    shift 2
fi
bash scripts/setup_envs.sh core lmcache
MODEL="$(.venvs/lmcache/bin/python scripts/tiny_model.py --size "$SIZE" | tail -n 1)"
exec .venvs/core/bin/python examples/quickstart.py --vllm .venvs/lmcache/bin/vllm --model "$MODEL" "$@"
