"""Index health per worker: how far placement may trust a worker's index entries.

A worker's index is `exact` while its stream is in order and nothing lags; `degraded` while a
stream gap is being replayed or for `index.degraded_s` after its engine reported fewer cached
tokens than predicted (evictions whose events lag) while such shortfalls add up to more than
`index.lag_tolerance` of the tokens predicted for its recent requests (a full cache evicts all
the time, and vLLM publishes an eviction at its next step: one late event among many correct
predictions is only counted, see `RequestAccount.overpredicted`, and must not discount every
other prefix on that worker); `fallback` when the index cannot be
trusted at all: no stream, a resync (for `index.degraded_s`, while the stream rebuilds it), a
stream silent while the worker answered requests that stored blocks (aged out), the engine down,
or a parity mismatch (its tokenizer or block size differs from the router's).

Placement reads matches through `trim`: a degraded worker's match keeps its leading blocks only
(evicted blocks are a chain's last ones: vLLM frees a request's blocks tail first), the share of
its recent predictions that held while evictions lag, half while a gap is replayed; a fallback
worker's match counts for none, so load decides there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from router.config import IndexConfig
from router.index import WorkerMatch
from warply.protocol import Tier
from warply.protocol.api import IndexHealthView, IndexState

if TYPE_CHECKING:  # router.metrics imports placement, which imports this module
    from router.metrics import RequestRecord

_log = logging.getLogger("warply.router")


class Stream(Protocol):
    """What the health needs of a worker's stream subscriber."""

    @property
    def replaying(self) -> bool: ...


@dataclass(slots=True)
class _Worker:
    has_stream: bool
    fallback: str = ""
    """A fallback that lasts until the stream delivers a batch (stream_silent, worker_down)."""
    parity_failure: str = ""
    """parity_tokenizer / parity_block_size: lasts until a parity check passes."""
    parity: str = "pending"
    resync_until: float = 0.0
    degraded_until: float = 0.0
    degraded_reason: str = ""
    last_batch: float = 0.0
    expect_since: float | None = None
    """A request that stored new blocks ended then, and no batch came after it was sent."""
    aged_out: int = 0
    predicted: float = 0.0
    missing: float = 0.0
    """Decayed sums over its recent requests of the cached tokens predicted, and of those the
    engine then did not report (its evictions' events not applied yet)."""


_LAG_DECAY = 1.0 - 1.0 / 32
"""Per request: a worker's predicted and missing sums reflect about its last 32 predictions."""


class IndexHealth:
    """Per-worker index health (see the module docstring); fed by the index feed, the request
    records and the parity check."""

    def __init__(self, config: IndexConfig) -> None:
        self._config = config
        self._workers: dict[str, _Worker] = {}
        self._streams: Mapping[str, Stream] = {}

    def watch(self, streams: Mapping[str, Stream]) -> None:
        """Read `replaying` from these subscribers (by worker name)."""
        self._streams = streams

    def joined(self, worker: str, has_stream: bool) -> None:
        self._workers[worker] = _Worker(has_stream, parity="pending" if has_stream else "off")
        if not self._config.parity_check:
            self._workers[worker].parity = "off"

    def left(self, worker: str) -> None:
        self._workers.pop(worker, None)

    def _get(self, worker: str) -> _Worker | None:
        return self._workers.get(worker)

    # -- what happens --------------------------------------------------------------------------

    def batch(self, worker: str) -> None:
        """The stream delivered a batch: it is alive."""
        if (w := self._get(worker)) is not None:
            w.last_batch = time.monotonic()
            w.expect_since = None
            if w.fallback:
                _log.info("worker %s: state stream back (%s over)", worker, w.fallback)
                w.fallback = ""

    def resynced(self, worker: str) -> None:
        """Its entries were dropped (an unrecoverable gap, a publisher restart)."""
        if (w := self._get(worker)) is not None:
            w.resync_until = time.monotonic() + self._config.degraded_s

    def lagging(self, worker: str) -> None:
        """Its engine reported fewer cached tokens than the index predicted."""
        if (w := self._get(worker)) is not None:
            w.degraded_until = time.monotonic() + self._config.degraded_s
            w.degraded_reason = "lagging_evictions"

    def down(self, worker: str) -> None:
        """Its engine refuses connections (crashed): its entries were dropped; parity is checked
        again when it is back."""
        if (w := self._get(worker)) is not None:
            w.fallback = "worker_down"
            w.expect_since = None
            if w.parity != "off":
                w.parity = "pending"

    def up(self, worker: str) -> None:
        """Its engine answers again after it was down: a new process, whose cache (and stream)
        start empty, as its index entries now are."""
        if (w := self._get(worker)) is not None and w.fallback == "worker_down":
            w.fallback = ""

    def block_size(self, worker: str, engine: int, pool: int) -> None:
        """Its engine stores blocks of another size than its pool's `block_size`."""
        if (w := self._get(worker)) is not None and not w.parity_failure:
            w.parity_failure = "parity_block_size"
            _log.error(
                "worker %s: engine blocks have %d tokens, its pool's block_size is %d; its "
                "prefix matches are not used (placed by load)", worker, engine, pool,
            )

    def parity_checked(self, worker: str, result: str, detail: str = "") -> None:
        """The tokenizer parity check ended: ok, mismatch or unchecked."""
        if (w := self._get(worker)) is None:
            return
        w.parity = result
        if result == "mismatch":
            w.parity_failure = "parity_tokenizer"
            _log.error(
                "worker %s: the engine tokenizes probe prompts differently from the router "
                "(%s); its prefix matches are not used (placed by load)", worker, detail,
            )
        elif w.parity_failure == "parity_tokenizer":
            w.parity_failure = ""

    def needs_parity(self, worker: str) -> bool:
        w = self._get(worker)
        return w is not None and w.parity == "pending"

    def observe(self, rec: RequestRecord) -> None:
        """An ended request: a prediction above the engine's report degrades the worker (when
        such shortfalls pass `lag_tolerance` of its recent predictions); a prompt that stored
        new blocks there means its stream must speak (`expired`)."""
        d = rec.decision
        if d is None or rec.status != 200:
            return
        leg, cached = rec.prefill_leg(d)
        w = self._get(leg.worker.name)
        if w is None:
            return
        # The index's own prediction, before `trim` cut it: measured while the caution is on,
        # so the shortfall falls again once the engine holds what the index says.
        indexed = leg.index_cached
        if cached is not None and indexed:
            w.predicted = w.predicted * _LAG_DECAY + indexed
            w.missing = w.missing * _LAG_DECAY + max(0, indexed - cached)
            lag = self._config.lag_tolerance * w.predicted
            if cached < indexed and w.missing > lag:
                self.lagging(leg.worker.name)
        bs = leg.worker.pool.block_size
        held = leg.predicted_cached if cached is None else cached
        if not w.has_stream or rec.prompt_tokens // bs * bs <= held:
            return
        now = time.monotonic()
        if w.last_batch < now - rec.latency_s and w.expect_since is None:
            w.expect_since = now

    def expired(self) -> list[str]:
        """Workers whose stream stayed silent `index.stale_after_s` after they stored blocks:
        now `fallback` (stream_silent) until it speaks; the caller drops their entries."""
        limit = self._config.stale_after_s
        if limit is None:
            return []
        now = time.monotonic()
        out = []
        for name, w in self._workers.items():
            if w.expect_since is not None and now - w.expect_since >= limit:
                w.expect_since = None
                w.fallback = "stream_silent"
                w.aged_out += 1
                _log.warning(
                    "worker %s: no state event for %.0f s after it stored blocks; its index "
                    "entries are aged out (placed by load until its stream speaks)", name, limit,
                )
                out.append(name)
        return out

    # -- what placement and the metrics see ------------------------------------------------------

    def view(self, worker: str) -> IndexHealthView:
        w = self._get(worker)
        if w is None:
            return IndexHealthView("exact")
        now = time.monotonic()
        state: IndexState = "exact"
        reason = ""
        stream = self._streams.get(worker)
        if not w.has_stream:
            state, reason = "fallback", "no_stream"
        elif w.parity_failure or w.fallback:
            state, reason = "fallback", w.parity_failure or w.fallback
        elif now < w.resync_until:
            state, reason = "fallback", "resync"
        elif stream is not None and stream.replaying:
            state, reason = "degraded", "replaying"
        elif now < w.degraded_until:
            state, reason = "degraded", w.degraded_reason
        return IndexHealthView(state, reason, w.parity, w.aged_out)

    def trim(self, matches: dict[str, WorkerMatch]) -> dict[str, WorkerMatch]:
        """`matches` as placement should weigh them: a worker lagging in evictions keeps the
        share of its leading blocks that its recent predictions found (1 − the shortfall), one
        replaying a gap half, a fallback worker none (one without a stream has no entries of
        its own: whatever the store holds for it was put there by its operator, and counts)."""
        out = dict(matches)
        for name, match in matches.items():
            if not match.blocks:
                continue
            view = self.view(name)
            if view.state == "exact" or view.reason == "no_stream":
                continue
            if view.state == "fallback":
                keep = 0
            elif view.reason == "lagging_evictions":
                keep = int(match.blocks * (1.0 - self.shortfall(name)))
            else:
                keep = match.blocks // 2
            out[name] = _shorter(match, keep)
        return out

    def shortfall(self, worker: str) -> float:
        """The share of the cached tokens predicted for `worker`'s recent requests that its
        engine did not report (0..1)."""
        w = self._get(worker)
        return w.missing / w.predicted if w is not None and w.predicted else 0.0


def _shorter(match: WorkerMatch, keep: int) -> WorkerMatch:
    """`match` cut to its first `keep` blocks, dropping the slowest tiers' blocks first."""
    by_tier: dict[Tier, int] = {}
    left = keep
    for tier in Tier:
        n = min(match.by_tier.get(tier, 0), left)
        if n:
            by_tier[tier] = n
        left -= n
    return WorkerMatch(keep, by_tier)
