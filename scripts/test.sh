#!/usr/bin/env bash
# Runs the whole test suite: lint + types + import layers + core tests in .venvs/core, then each engine's
# integration tests in its own venv (vLLM: tests/vllm in .venvs/vllm; SGLang: tests/sglang in
# .venvs/sglang; vLLM with a real LMCache server: tests/lmcache in .venvs/lmcache). Installs what
# it needs first (idempotent, cached per machine), including Debian's redis-server and libibverbs1
# (sudo unless root).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/script_help.sh" "$@"  # --help: the comment above
if [[ $# -gt 0 ]]; then
    echo "scripts/test.sh takes no arguments (got '$1'); --help says what it runs" >&2
    exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# Debian packages: redis-server (the shared index store's tests and the redis tier start one) and
# libibverbs1 (the Mooncake wheel's transfer engine links it, even for TCP).
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
dpkg -s libibverbs1 >/dev/null 2>&1 || missing+=(libibverbs1)
if [[ ${#missing[@]} -gt 0 ]]; then
    SUDO=""
    [[ "$(id -u)" -ne 0 ]] && SUDO="sudo"
    echo "[setup] installing ${missing[*]}" >&2
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null; } || exit 1
fi
bash scripts/setup_envs.sh core vllm sglang lmcache || exit 1

REPORTS="$(mktemp -d)"
trap 'rm -rf "$REPORTS"' EXIT
status=0
step() { printf '\n=== %s ===\n' "$1"; }

step "ruff"
.venvs/core/bin/ruff check . || status=1
step "mypy"
.venvs/core/bin/mypy || status=1
step "import layers (lint-imports: the contracts in pyproject.toml)"
.venvs/core/bin/lint-imports --no-cache || status=1

suite() {  # suite NAME VENV PYTEST-ARGS...
    local name="$1" venv="$2"
    shift 2
    step "pytest: $name suite (.venvs/$venv)"
    ".venvs/$venv/bin/python" -m pytest -p no:cacheprovider --junitxml="$REPORTS/$name.xml" "$@"
    local rc=$?
    [[ $rc -eq 0 || $rc -eq 5 ]] || status=1   # 5: nothing collected in that suite
}
suite core core tests --ignore=tests/vllm --ignore=tests/sglang --ignore=tests/lmcache
suite vllm vllm tests/vllm
suite sglang sglang tests/sglang
suite lmcache lmcache tests/lmcache

step "summary"
.venvs/core/bin/python - "$REPORTS" <<'PY'
import sys, pathlib, xml.etree.ElementTree as ET
tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.xml")):
    for s in ET.parse(f).getroot().iter("testsuite"):
        n = {k: int(s.get(k, 0)) for k in tot}
        print(f"{f.stem:7s}: {n['tests']} tests, {n['failures'] + n['errors']} failed, {n['skipped']} skipped")
        for k in tot:
            tot[k] += n[k]
failed = tot["failures"] + tot["errors"]
print(f"total: {tot['tests'] - failed - tot['skipped']} passed, {failed} failed, {tot['skipped']} skipped")
PY
exit $status
