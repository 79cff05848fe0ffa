"""WarplyConnector metrics: counters, the stats object vLLM logs, and `vllm:warply_*` series.

vLLM 0.32 flow: each step the scheduler asks the connector for `get_kv_connector_stats()`,
aggregates it with the workers' stats, ships `to_dict()` to the API server, which rebuilds it
with the class method `build_kv_connector_stats(data)` for the "KV Transfer metrics" log line and
passes the dict to `build_prom_metrics(...).observe()` for /metrics. The delegate's own stats ride
along under "delegate", keyed by its registered name so the API server can rebuild them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine


@dataclass
class WarplyCounters:
    """Scheduler-side counts since the last stats interval (reset when taken)."""

    events_exported: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    events_skipped: int = 0
    prefix_hit_blocks: int = 0
    directives_applied: int = 0
    directives_rejected: int = 0
    directives_refused: int = 0
    """Control-socket messages refused unapplied: undecodable, or (with a control_token)
    unsigned, wrongly signed, stale or replayed."""
    export_seconds: float = 0.0
    export_steps: int = 0
    export_backlog: int = 0
    """Gauge: batches handed to the publisher thread but not yet sent."""

    def take(self) -> dict[str, float]:
        """The counts as a dict, and reset them (the backlog gauge is kept)."""
        out = asdict(self)
        backlog = self.export_backlog
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())
        self.export_backlog = backlog
        return out


_GAUGES = frozenset({"export_backlog"})


@dataclass
class WarplyConnectorStats(KVConnectorStats):
    """`data = {"warply": counters, "delegate": stats-or-dict, "delegate_name": name}`."""

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Sum counters (gauges: latest); aggregate the delegate's stats with its own rule."""
        theirs = other.data if isinstance(other, WarplyConnectorStats) else {}
        mine: dict[str, float] = self.data.setdefault("warply", {})
        for key, value in theirs.get("warply", {}).items():
            mine[key] = value if key in _GAUGES else mine.get(key, 0) + value
        other_delegate = theirs.get("delegate")
        if other_delegate is not None:
            current = self.data.get("delegate")
            self.data["delegate"] = (
                other_delegate if current is None else current.aggregate(other_delegate)
            )
            self.data["delegate_name"] = theirs.get("delegate_name")
        return self

    def reset(self) -> None:
        """Drop everything collected."""
        self.data = dict[str, Any]()

    def reduce(self) -> dict[str, int | float]:
        """One line of numbers for vLLM's periodic log."""
        w = self.data.get("warply", {})
        out: dict[str, int | float] = {
            k: v for k, v in w.items() if k not in ("export_seconds", "export_steps")
        }
        if w.get("export_steps"):
            out["export_ms_per_step"] = round(1000 * w["export_seconds"] / w["export_steps"], 4)
        delegate = self.data.get("delegate")
        if isinstance(delegate, KVConnectorStats) and not delegate.is_empty():
            name = self.data.get("delegate_name", "delegate")
            out.update({f"{name}.{k}": v for k, v in delegate.reduce().items()})
        return out

    def is_empty(self) -> bool:
        """True when nothing happened (no counts, no delegate stats)."""
        w = self.data.get("warply", {})
        delegate = self.data.get("delegate")
        delegate_empty = delegate is None or (
            isinstance(delegate, KVConnectorStats) and delegate.is_empty()
        )
        return delegate_empty and not any(v for k, v in w.items() if k not in _GAUGES)

    def to_dict(self) -> dict[str, Any]:
        """Serializable form (the delegate's stats as its own `to_dict()`)."""
        out: dict[str, Any] = {"warply": dict(self.data.get("warply", {}))}
        delegate = self.data.get("delegate")
        if delegate is not None:
            out["delegate_name"] = self.data.get("delegate_name")
            out["delegate"] = (
                delegate.to_dict() if isinstance(delegate, KVConnectorStats) else delegate
            )
        return out


def build_stats(data: dict[str, Any] | None) -> WarplyConnectorStats:
    """Rebuild stats from `to_dict()` output (the delegate's through its own class method)."""
    if not data:
        return WarplyConnectorStats()
    out: dict[str, Any] = {"warply": dict(data.get("warply", {}))}
    name = data.get("delegate_name")
    delegate = data.get("delegate")
    if name and delegate is not None:
        if not isinstance(delegate, KVConnectorStats):
            cls = KVConnectorFactory.get_connector_class_by_name(name)
            delegate = cls.build_kv_connector_stats(data=delegate)
        if delegate is not None:
            out["delegate"], out["delegate_name"] = delegate, name
    return WarplyConnectorStats(data=out)


class WarplyPromMetrics(KVConnectorPromMetrics):
    """`vllm:warply_*` series; the delegate's own Prometheus metrics are observed beside them."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        delegate: KVConnectorPromMetrics | None,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._delegate = delegate

        def counter(name: str, doc: str) -> dict[int, Any]:
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self._counters = {
            "events_exported": counter(
                "vllm:warply_events_exported", "State events published by Warply."
            ),
            "blocks_stored": counter(
                "vllm:warply_blocks_stored", "Device blocks reported cached by Warply."
            ),
            "blocks_removed": counter(
                "vllm:warply_blocks_removed", "Device blocks reported dropped by Warply."
            ),
            "events_skipped": counter(
                "vllm:warply_events_skipped",
                "KV events not exported (unknown medium, no tokens, a clear with no tier).",
            ),
            "prefix_hit_blocks": counter(
                "vllm:warply_prefix_hit_blocks", "Cached device blocks reused by requests."
            ),
            "directives_applied": counter(
                "vllm:warply_directives_applied", "Warply directives applied."
            ),
            "directives_rejected": counter(
                "vllm:warply_directives_rejected", "Warply directives rejected."
            ),
            "directives_refused": counter(
                "vllm:warply_directives_refused",
                "Directive-socket messages refused unapplied (undecodable; with a "
                "control_token: unsigned, bad signature, stale or replayed).",
            ),
            "export_seconds": counter(
                "vllm:warply_export_seconds",
                "Scheduler-thread time spent converting and handing off state events.",
            ),
        }
        backlog = self._gauge_cls(
            name="vllm:warply_export_lag_batches",
            documentation="State batches queued for the publisher thread, not yet sent.",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self._backlog = create_metric_per_engine(backlog, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one interval's counts (and forward the delegate's part)."""
        warply = transfer_stats_data.get("warply", {})
        for key, per_engine in self._counters.items():
            value = warply.get(key, 0)
            if value:
                per_engine[engine_idx].inc(value)
        if "export_backlog" in warply:
            self._backlog[engine_idx].set(warply["export_backlog"])
        delegate = transfer_stats_data.get("delegate")
        if self._delegate is not None and delegate is not None:
            self._delegate.observe(delegate, engine_idx)
