"""Engines' own KV-transfer counters, read from their Prometheus text (`GET /metrics`).

vLLM's NixlConnector exports, on the engine that pulls the KV (the decode side),
`vllm:nixl_bytes_transferred` and `vllm:nixl_xfer_time_seconds` (histograms: `_sum`, `_count`),
`vllm:nixl_num_failed_transfers`, and every engine `vllm:prompt_tokens_cached_by_source_total`
(`source="p2p"`: prompt tokens taken from another engine's cache). The router reads them with
its health probe and shows them per decode worker; nothing here does I/O.
"""

from __future__ import annotations

import math
import re

from warply.protocol.api import KvTransferStats

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN|[+-]Inf)")
_WANTED = {
    "vllm:nixl_bytes_transferred_sum": "bytes",
    "vllm:nixl_bytes_transferred_count": "transfers",
    "vllm:nixl_xfer_time_seconds_sum": "seconds",
    "vllm:nixl_num_failed_transfers_total": "failed",
}
_P2P = "vllm:prompt_tokens_cached_by_source_total"


def kv_transfer_stats(text: str) -> KvTransferStats:
    """The counters in one engine's Prometheus text, summed over label sets (0 when absent)."""
    found = {"bytes": 0.0, "transfers": 0.0, "seconds": 0.0, "failed": 0.0, "p2p": 0.0}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        field = _WANTED.get(name)
        if field is None and name == _P2P and 'source="p2p"' in (labels or ""):
            field = "p2p"
        if field is not None:
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):  # NaN / ±Inf (a broken exporter): int() of it raised
                found[field] += number
    return KvTransferStats(
        transfers=int(found["transfers"]),
        bytes=int(found["bytes"]),
        seconds=found["seconds"],
        failed=int(found["failed"]),
        p2p_tokens=int(found["p2p"]),
    )
