"""What the router measures: hit rates, bytes cached by tier, evictions, affinity, TTFT, overhead.

Prometheus series live in the router's own registry (`/metrics`, `registry.py`); the same
numbers, plus windowed quantiles and the affinity map, are served as the typed `CacheStats`
(`/warply/cache_stats`, `stats.py`). Hit rate comes in two flavours: *predicted* (what the
index said the chosen worker holds) and *engine* (what the engine's
`usage.prompt_tokens_details.cached_tokens` reported); engines with the WarplyConnector also
confirm each prefix hit on their state stream (`PrefixHit`), counted per worker.
`min_hit_ratio` raises an alert (log line, gauge, optional callback) when the windowed hit rate
falls below it (`alerts.py`). `RouterMetrics` (`recorder.py`) feeds all three, one
`RequestRecord` per request when it ends. Decode engines' own KV-transfer counters are parsed
from their /metrics text (`engines.py`).
"""

from router.metrics.alerts import HitAlert, HitWindow, Sample
from router.metrics.engines import kv_transfer_stats
from router.metrics.record import RequestRecord
from router.metrics.recorder import RouterMetrics

__all__ = [
    "HitAlert", "HitWindow", "RequestRecord", "RouterMetrics", "Sample", "kv_transfer_stats"
]
