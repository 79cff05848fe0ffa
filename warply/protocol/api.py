"""The router's public JSON shapes: per-request overrides, `/warply/cache_stats`, `/warply/workers`.

The router builds these structs and serves `msgspec.json.encode(...)` of them; the SDK and the
CLI read a response back with `msgspec.json.decode(body, type=CacheStats)` (or `WorkerList`)
instead of walking ad-hoc dicts. No router imports: this is the contract both sides share.
Counts are lifetime totals since the router started; ratios are None until they have a
denominator.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

AUTH_TOKEN_ENV = "WARPLY_AUTH_TOKEN"
"""The environment variable holding the router's admin token: the router reads it when its
config sets none, the CLI sends it, the Kubernetes manifests fill it from a Secret."""

Role = Literal["prefill", "decode", "both"]
"""What a worker serves: the prompt's prefill, the decode after a hand-off, or both."""

IndexState = Literal["exact", "degraded", "fallback"]
"""How far the router trusts a worker's index entries. `exact`: its stream is in order and
nothing lags; `degraded`: a gap is being replayed, or its engine lately reported fewer cached
tokens than predicted (evictions lag), so its matches count for less; `fallback`: no usable
stream (none configured, resynced and not yet rebuilt, silent while the worker answers, the
engine down, or a tokenizer / block-size mismatch): it is placed by load alone."""

BreakerState = Literal["closed", "open", "half_open"]
"""A worker's circuit breaker: `open` takes it out of placement; `half_open` lets one request
at a time try it."""


CacheKey = Annotated[str, msgspec.Meta(min_length=1, pattern="^[^\x00]*$")]
"""A tenant's cache namespace: non-empty (vLLM refuses an empty `cache_salt`) and without NUL,
the separator of the namespace's parts (`protocol.normalize.cache_namespace`), so no key can
name another tenant's namespace on an adapter (`"a\0sql"` is tenant `a` on adapter `sql`)."""


class Overrides(msgspec.Struct, forbid_unknown_fields=True):
    """`extra_body={"warply": {...}}`: per-request cache namespace and reuse switch."""

    cache_key: CacheKey | None = None
    """The request's cache namespace (forwarded to the engine as `cache_salt`)."""
    prefix_reuse: bool = True
    """False: place by load alone."""


# -- /warply/cache_stats --------------------------------------------------------------------------


class HitRates(msgspec.Struct):
    """Cached / prompt tokens: *predicted* by the index for the chosen worker, and reported by
    the engine (`usage.prompt_tokens_details.cached_tokens`); lifetime and over the alert window."""

    predicted: float | None
    engine: float | None
    window_predicted: float | None
    window_engine: float | None


class IndexView(msgspec.Struct):
    """What the prefix index holds, and those entries as KV bytes."""

    entries: int
    """(block, worker) entries."""
    entries_by_tier: dict[str, int]
    evictions: int
    """Entries the index's own cap dropped."""
    skipped: dict[str, int]
    """Events the index could not apply, by reason."""
    bytes_cached: int
    bytes_by_tier: dict[str, int]
    bytes_by_pool: dict[str, int]
    overpredicted: dict[str, int] = {}
    """Blocks per worker the index credited that its engine then reported not cached (evicted
    between placement and the engine's scheduling, or an eviction event not applied yet)."""


class WorkerStats(msgspec.Struct):
    """One worker's share of the traffic and of the cache hits."""

    requests: int = 0
    prompt_tokens: int = 0
    predicted_cached_tokens: int = 0
    engine_cached_tokens: int = 0
    """From the engine's usage blocks of requests the router routed."""
    engine_prefix_hits: int = 0
    """Requests the engine itself reported reusing a cached prefix for (`PrefixHit` on its state
    stream, WarplyConnector), whoever sent them."""
    engine_prefix_hit_tokens: int = 0
    """Prompt tokens those requests reused (engine-confirmed, beside the router's prediction)."""
    in_flight: int = 0
    healthy: bool = False
    index_state: IndexState = "exact"
    predicted_hit_rate: float | None = None
    """predicted_cached_tokens / prompt_tokens of the prompts it computed."""
    engine_hit_rate: float | None = None
    """engine_cached_tokens / prompt tokens of the prompts it computed that reported usage."""
    handoffs: int = 0
    """Requests it decoded after a prefill worker computed their prompt (P/D hand-off); they
    are not in `requests`, which counts the prompts it computed itself."""
    handoff_prompt_tokens: int = 0
    handoff_held_tokens: int = 0
    """Prompt tokens of those hand-offs it already held (index view): not transferred."""


class PoolStats(msgspec.Struct):
    """One pool's (or one role's) share of the traffic and of the cache hits.

    `requests` .. `engine_cached_tokens` count the prompts its workers computed themselves
    (aggregated requests, prefill legs of hand-offs, local prefills on decode workers): the hit
    rate of the pool or role is engine_cached / prompt tokens. The `handoff_*` numbers are the
    decode side of hand-offs: prompts whose KV it pulled from a prefill worker, and how much of
    them it already held (predicted by the index; those blocks are not transferred)."""

    role: str
    requests: int = 0
    prompt_tokens: int = 0
    predicted_cached_tokens: int = 0
    engine_cached_tokens: int = 0
    hit_rate: float | None = None
    """engine_cached_tokens / prompt_tokens of the requests that reported usage."""
    handoffs: int = 0
    handoff_prompt_tokens: int = 0
    handoff_held_tokens: int = 0
    """Decode-side reuse: prompt tokens of hand-offs the decode worker already held."""
    engine_prefix_hit_tokens: int = 0
    """Prompt tokens its engines reported reusing (`PrefixHit`), on either path."""


class TenantStats(msgspec.Struct):
    """One cache namespace's (`cache_key`, LoRA adapter) prompts: predicted against
    engine-delivered hits."""

    requests: int = 0
    prompt_tokens: int = 0
    predicted_cached_tokens: int = 0
    engine_cached_tokens: int = 0
    engine_prompt_tokens: int = 0
    """Prompt tokens of its requests whose engine reported usage."""
    predicted_hit_rate: float | None = None
    engine_hit_rate: float | None = None


class KvTransferStats(msgspec.Struct):
    """A decode worker's KV transfers, from the engine's own counters (vLLM `vllm:nixl_*`,
    `vllm:prompt_tokens_cached_by_source_total{source="p2p"}`), read with the health probe."""

    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0
    """Summed transfer time (`vllm:nixl_xfer_time_seconds_sum`)."""
    failed: int = 0
    p2p_tokens: int = 0
    """Prompt tokens the engine took from another engine's cache instead of computing them."""


class TtftBreakdown(msgspec.Struct):
    """Where a handed-off request's time to first token goes, per request (p50 / p99): router
    queue (receipt → first upstream request), prefill (the prefill worker's answer), and the
    decode worker's first token (KV transfer + first decode step; the transfer alone is the
    engine's `KvTransferStats.seconds / transfers`)."""

    queue_s: Quantiles
    prefill_s: Quantiles
    decode_first_token_s: Quantiles


class PdStats(msgspec.Struct):
    """The prefill → decode hand-off."""

    local_prefill_tokens: int
    """The conditional-disaggregation threshold in force (`pd.local_prefill_tokens`)."""
    decisions: dict[str, int]
    """Requests by how they were served: `remote` (handed off), `local:below_threshold`,
    `local:cheaper_local`, `local:no_prefill_worker`, `local:prefill_failed` (decode
    prefilled), `aggregated`."""
    prefill_failures: dict[str, int]
    """Prefill legs that failed, by reason (connect, timeout, error, status_NNN,
    no_kv_transfer_params); each fell back to a local prefill on the decode worker."""
    ttft: TtftBreakdown
    transfers: dict[str, KvTransferStats]
    """Per decode worker."""


class AffinityEntry(msgspec.Struct):
    """Which workers served the prompts starting with one (namespace, first block)."""

    namespace: str
    first_block: str
    """The first block's canonical key, 16 hex digits."""
    workers: dict[str, int]


class Quantiles(msgspec.Struct):
    """p50 / p99 over the recent window (None while it is empty)."""

    n: int
    p50: float | None
    p99: float | None


class TokenizerCacheStats(msgspec.Struct):
    """The router tokenizer's chunk cache (chunks, not tokens)."""

    hits: int
    misses: int
    bytes: int


class AlertState(msgspec.Struct):
    min_hit_ratio: float
    firing: bool


class StrategyState(msgspec.Struct):
    """One pool's strategy, as it measures itself (e.g. the adaptive default's eviction loss,
    queue depth and duplication price; empty for strategies that keep no state)."""

    gauges: dict[str, float] = msgspec.field(default_factory=dict)
    workers: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    """Name → worker → value (e.g. `routed_share`: 1 = the worker's fair share of work)."""


class TieringStats(msgspec.Struct):
    """The tier policy the router runs, and what became of its directives."""

    policy: str
    rounds: int = 0
    policy_failures: int = 0
    """Rounds whose `decide` raised (logged; routing went on)."""
    last_error: str = ""
    directives: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    """Kind → outcome → count; outcomes: applied, rejected (the plugin's ack said no), timeout,
    error (unreachable), no_control (worker has no control endpoint), dropped (over the
    per-round cap), refused (a pin over its namespace's `tiering.pin_budget`, not sent)."""
    last_rejection: str = ""
    """The reason of the latest rejection, as the plugin gave it."""
    tracked_prefixes: int = 0
    pinned_prefixes: int = 0
    pinned_bytes: dict[str, int] = msgspec.field(default_factory=dict)
    """Namespace → bytes its applied pins hold, every tier and worker (`tiering.pin_budget`)."""


class CacheStats(msgspec.Struct):
    """`GET /warply/cache_stats`."""

    strategy: str
    requests: int
    prompt_tokens: int
    placed_early: int
    """Requests placed from their prompt's leading part (the rest tokenized after)."""
    hit_rate: HitRates
    predicted_cached_tokens: int
    engine_cached_tokens: int
    index: IndexView
    evictions_by_pool: dict[str, int]
    """Blocks engines reported removed."""
    workers: dict[str, WorkerStats]
    affinity: list[AffinityEntry]
    """The busiest (namespace, first block) slots first."""
    ttft_s: Quantiles
    overhead_s: Quantiles
    tokenizer_cache: TokenizerCacheStats | None
    alert: AlertState
    pools: dict[str, PoolStats] = msgspec.field(default_factory=dict)
    roles: dict[str, PoolStats] = msgspec.field(default_factory=dict)
    """The same numbers summed per role (`prefill`, `decode`, `both`)."""
    pd: PdStats | None = None
    """None unless some pool has role `prefill` or `decode`."""
    strategy_state: dict[str, StrategyState] = msgspec.field(default_factory=dict)
    """Per pool, its strategy's measured state (`Strategy.gauges` / `worker_gauges`)."""
    tiering: TieringStats | None = None
    """None unless a tier policy runs (`tiering` in the router config)."""
    tenants: dict[str, TenantStats] = msgspec.field(default_factory=dict)
    """Per cache namespace ("" for requests without one; the most recently active ones, capped),
    the client's view: what the index predicted cached against what the engines reported."""
    placed_unkeyed: int = 0
    """Requests placed by load alone, nothing predicted: their prompt holds media (images,
    audio, video) the router cannot key, so the engine may report hits it did not predict."""


# -- /warply/workers ------------------------------------------------------------------------------


class StreamStats(msgspec.Struct):
    """A worker's state-stream subscriber."""

    endpoint: str
    last_seq: int | None
    gaps: int
    replayed: int
    resyncs: int
    rejected: dict[str, int]
    """Frames dropped, by reason."""


class IndexHealthView(msgspec.Struct):
    """How far the router trusts a worker's index entries, and why (`IndexState`)."""

    state: IndexState
    reason: str = ""
    """Why it is not `exact` (e.g. replaying, lagging_evictions, resync, no_stream,
    stream_silent, worker_down, parity_tokenizer, parity_block_size)."""
    parity: str = "pending"
    """The tokenizer parity check: pending, ok, mismatch, unchecked (the engine has no
    /tokenize), or off."""
    aged_out: int = 0
    """Times its entries were aged out (stream silent while it answered requests)."""


class WorkerView(msgspec.Struct):
    """One worker: membership, health, drain state, load, stream."""

    name: str
    pool: str
    url: str
    healthy: bool
    enabled: bool
    """False while drained."""
    in_flight: int
    """Requests the router has sent it that have not finished."""
    in_flight_tokens: int
    engine_waiting: int
    """The engine's own queues and KV occupancy, from its last `LoadSnapshot`."""
    kv_usage: float
    stream: StreamStats | None
    """None: the worker has no state stream."""
    engine_running: int = 0
    kv_blocks_total: int = 0
    """The engine's KV capacity in blocks (0: not reported)."""
    role: Role = "both"
    failed_probes: int = 0
    """`/health` probes failed in a row (it leaves placement at `unhealthy_after`)."""
    kv_bytes_per_block: int = 0
    """KV bytes per block as the engine reports it (0: not reported)."""
    leaving: bool = False
    """Being removed (DELETE /warply/workers/{name}): it takes no new request."""
    breaker: BreakerState = "closed"
    breaker_trips: int = 0
    """Times its circuit breaker opened."""
    index: IndexHealthView | None = None


class WorkerList(msgspec.Struct):
    """`GET /warply/workers`."""

    workers: list[WorkerView]


# -- /warply/where --------------------------------------------------------------------------------


class ScoreView(msgspec.Struct):
    """A candidate's score in its pool's strategy (`router.strategies.Score`)."""

    rule: str
    """Which of the strategy's rules ranked the candidates (e.g. "longest cached prefix")."""
    key: list[float]
    """What the strategy minimises, in order: the smallest wins, exact ties in turn."""
    terms: dict[str, float]
    """The named numbers behind the key (the strategy's formula, docs/router.md)."""


class WorkerWhere(msgspec.Struct):
    """How much of the prompt one worker holds, and how its pool's strategy scores it."""

    name: str
    available: bool
    """Healthy, enabled and not leaving: a candidate for the request."""
    blocks: int
    """Leading blocks of the prompt held, on any tier."""
    cached_tokens: int
    """Prompt tokens its engine would report cached (full blocks, never the last token)."""
    blocks_by_tier: dict[str, int]
    """Those leading blocks by the fastest tier that holds each."""
    score: ScoreView | None = None
    """None: not a candidate, its pool was not asked, or the strategy explains no scores."""


class PoolWhere(msgspec.Struct):
    """One pool's view of the prompt."""

    name: str
    role: Role
    block_size: int
    strategy: str
    prompt_blocks: int
    """The prompt's full blocks in this pool's block size."""
    pick: str | None
    """The pool strategy's pick (None: not asked, or no available worker)."""
    workers: list[WorkerWhere]


class WhereChoice(msgspec.Struct):
    """Where the router would send the prompt now."""

    worker: str
    """The worker that would answer (aggregated or decode)."""
    mode: str
    """`aggregated`, `remote` (handed off: `prefill_worker` prefills) or `local` (a decode
    worker prefills itself, for `local_reason`)."""
    predicted_cached_tokens: int
    prefill_worker: str | None = None
    local_reason: str = ""


class Where(msgspec.Struct):
    """`GET /warply/where?prompt=...` or `POST /warply/where` with a request body: which workers
    hold how much of a prompt on which tier, and what the router would choose and why. Nothing
    is booked or changed."""

    model: str
    strategy: str
    """The router's strategy (it compares the pools' picks)."""
    namespace: str
    """The request's cache namespace (cache_key / cache_salt, LoRA adapter)."""
    prompt_tokens: int
    prefix_reuse: bool
    choice: WhereChoice | None
    unavailable: str
    """Why no worker would take the request ("" when `choice` is set)."""
    pools: list[PoolWhere]
