"""Replay reports: per-strategy metrics, reuse references, and their table, JSON and PNG forms.

Metrics per strategy (simulated time):
  reuse        = Σ reused prompt tokens / Σ prompt tokens (first admission of each request; for
                 a P/D hand-off the prefill engine's, what the router reports to the client)
  TTFT         = first token − arrival (mean, p50, p90, p99), ms
  ITL          = (finish − first token) / (output tokens − 1), per request (mean, p50, p99), ms
  throughput   = output tokens / (last finish − first arrival), tokens/s
  imbalance    = max / mean of prefill tokens computed per worker
  decision     = router time per request (index match + strategy), µs (mean, p99)
  vs_pooled_lru = reuse / reuse of one LRU cache with the workers' pooled capacity (can be > 1)
  P/D          = requests by mode (remote / local / aggregated), KV bytes and tokens moved P→D
  busy         = seconds each engine spent in scheduler passes (× a price per engine: cost)
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from replay.sim import ReplayResult


def _pct(values: Any, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def latency_fields(ttft_ms: Any, itl_ms: Any) -> dict[str, float]:
    """TTFT mean/p50/p90/p99 and ITL mean/p50/p99 (ms): the columns simulated and live share."""
    ttft, itl = np.asarray(ttft_ms, dtype=float), np.asarray(itl_ms, dtype=float)
    return {
        "ttft_mean_ms": float(ttft.mean()) if len(ttft) else 0.0,
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p90_ms": _pct(ttft, 90),
        "ttft_p99_ms": _pct(ttft, 99),
        "itl_mean_ms": float(itl.mean()) if len(itl) else 0.0,
        "itl_p50_ms": _pct(itl, 50),
        "itl_p99_ms": _pct(itl, 99),
    }


def summarize(result: ReplayResult, pooled_lru: float | None = None) -> dict[str, Any]:
    """The metrics of one replay (module docstring), as a flat JSON-ready dict."""
    reqs = result.requests
    prompt = sum(r.prompt for r in reqs)
    reuse = sum(r.cached_tokens for r in reqs) / prompt if prompt else 0.0
    ttft = [r.first_token - r.arrival for r in reqs]
    itl = [(r.finished - r.first_token) / (r.output - 1) for r in reqs if r.output > 1]
    span_ms = max(r.finished for r in reqs) - min(r.arrival for r in reqs) if reqs else 0.0
    out_tokens = sum(r.output for r in reqs)
    work = [e.stats.prefill_tokens for e in result.engines.values()]
    decisions = np.array(result.decision_s) * 1e6
    served = result.served.values()
    modes = Counter(s.mode for s in served)
    pd = modes["aggregated"] < len(result.served)
    moved = sum(s.bytes_moved for s in served)
    return {
        "strategy": result.label,
        "workers": result.workers,
        "deployment": result.deployment,
        "requests": len(reqs),
        "rejected": result.rejected,
        "reuse": reuse,
        "host_reuse": sum(r.host_tokens for r in reqs) / prompt if prompt else 0.0,
        "vs_pooled_lru": reuse / pooled_lru if pooled_lru else None,
        **latency_fields(ttft, itl),
        "throughput_tok_s": out_tokens / (span_ms / 1000) if span_ms else 0.0,
        "imbalance": max(work) / (sum(work) / len(work)) if sum(work) else 1.0,
        "preemptions": sum(e.stats.preemptions for e in result.engines.values()),
        "evictions": sum(e.stats.evictions for e in result.engines.values()),
        "remote": modes["remote"],
        "local": modes["local"],
        "on_prefill": modes["on_prefill"],
        "remote_share": modes["remote"] / len(result.served) if pd else None,
        "bytes_moved": moved if pd else None,
        "bytes_moved_gb": moved / 1e9 if pd else None,
        "moved_tokens": sum(s.moved_tokens for s in served),
        "busy_s": {name: e.stats.busy_ms / 1000 for name, e in result.engines.items()},
        "decision_mean_us": float(decisions.mean()) if len(decisions) else 0.0,
        "decision_p99_us": _pct(decisions, 99),
        "wall_s": result.wall_s,
        "cpu_s": result.cpu_s,
        **({"tiering": msgspec.to_builtins(result.tiering)} if result.tiering is not None else {}),
    }


_COLUMNS = (
    ("strategy", "strategy", "{}"),
    ("deployment", "N", "{}"),
    ("reuse", "reuse", "{:.3f}"),
    ("vs_pooled_lru", "/pLRU", "{:.0%}"),
    ("ttft_mean_ms", "TTFT ms", "{:.1f}"),
    ("ttft_p50_ms", "p50", "{:.1f}"),
    ("ttft_p90_ms", "p90", "{:.1f}"),
    ("ttft_p99_ms", "p99", "{:.1f}"),
    ("itl_mean_ms", "ITL ms", "{:.2f}"),
    ("throughput_tok_s", "tok/s", "{:.0f}"),
    ("imbalance", "imbal", "{:.2f}"),
    ("preemptions", "preempt", "{}"),
    ("remote_share", "remote", "{:.0%}"),
    ("bytes_moved_gb", "P→D GB", "{:.1f}"),
    ("decision_mean_us", "decide µs", "{:.0f}"),
    ("cpu_s", "sim CPU s", "{:.1f}"),
)


def table(rows: Sequence[dict[str, Any]], oracles: dict[str, float]) -> str:
    """A plain-text table of `summarize` rows, with the reuse references underneath."""
    cells = [[h for _, h, _ in _COLUMNS]]
    for row in rows:
        cells.append(["-" if row[k] is None else fmt.format(row[k]) for k, _, fmt in _COLUMNS])
    widths = [max(len(c[i]) for c in cells) for i in range(len(_COLUMNS))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [f"{name}: reuse {value:.3f}" for name, value in oracles.items()]
    return "\n".join(lines)


def write_json(path: str | Path, report: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def plot(path: str | Path, rows: Sequence[dict[str, Any]], oracles: dict[str, float]) -> None:
    """Bar charts of reuse (with the reuse references as lines) and TTFT mean/p99 per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['strategy']}\nN={r['deployment']}" for r in rows]
    x = np.arange(len(rows))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6.0, 1.1 * len(rows) + 2), 7))
    ax1.bar(x, [r["reuse"] for r in rows], color="tab:blue")
    for (name, value), style in zip(oracles.items(), ("--", ":", "-.", "-"), strict=False):
        ax1.axhline(value, linestyle=style, color="black", linewidth=1, label=name)
    ax1.set_ylabel("prefix reuse")
    ax1.set_xticks(x, labels, fontsize=7)
    ax1.legend(fontsize=7)
    ax2.bar(x - 0.2, [r["ttft_mean_ms"] for r in rows], 0.4, label="mean", color="tab:green")
    ax2.bar(x + 0.2, [r["ttft_p99_ms"] for r in rows], 0.4, label="p99", color="tab:red")
    ax2.set_ylabel("TTFT (ms, simulated)")
    ax2.set_yscale("log")
    ax2.set_xticks(x, labels, fontsize=7)
    ax2.legend(fontsize=7)
    fig.suptitle("warply bench replay (simulated engines)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
