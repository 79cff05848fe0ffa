"""`TierRunner`: runs the configured tier policy every `interval_s` on the router's event loop
and sends its actions to the workers' plugin control sockets (`router.control`).

Each round: snapshot (tracked prefixes → index matches, worker bytes and load) → `decide` →
at most `max_directives` directives, sent concurrently, each awaited for its ack. Outcomes are
counted per kind (Prometheus `warply_tiering_directives_total`, `cache_stats().tiering`); a
policy that raises is logged and counted, and the round ends there. Routing never waits on it.

The clock and the delivery are parameters: the router uses wall time and the plugins' control
sockets; the replay (`replay.sim`) runs the same rounds in simulated time and delivers to its
simulated engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import zmq

from router.config import TieringConfig
from router.control import send_directive
from router.index import PrefixIndex
from router.metrics.record import RequestRecord
from router.metrics.registry import Series
from router.metrics.stats import block_bytes, tier_bytes
from router.placement import Decision
from router.tiering.base import Action, TierPolicy
from router.tiering.registry import make_policy
from router.tiering.state import PrefixId, PrefixState, PrefixTracker, TierState, WorkerState
from router.workers import Workers
from warply.protocol import Directive, DirectiveAck, DirectiveKind, Tier
from warply.protocol.api import TieringStats

_log = logging.getLogger(__name__)

Deliver = Callable[[str, Directive], Awaitable[DirectiveAck | None]]
"""Sends a directive to the named worker and returns its ack; None when the worker has no
control endpoint. Raises TimeoutError (no ack in time), or zmq.ZMQError / OSError (unreachable)."""


class TierRunner:
    """Owns the policy, the prefix tracker and the marks the acks leave (pins, copies)."""

    def __init__(
        self,
        config: TieringConfig,
        index: PrefixIndex,
        workers: Workers,
        series: Series,
        policy: TierPolicy | None = None,
        control_token: str | None = None,
        clock: Callable[[], float] = time.time,
        deliver: Deliver | None = None,
    ) -> None:
        self.config = config
        self._token = control_token
        """Signs directives (the router's `control_token`; None: unsigned)."""
        self.policy = policy if policy is not None else make_policy(config.policy)
        self.tracker = PrefixTracker(config.max_prefixes, config.max_prefix_blocks)
        self._index = index
        self._workers = workers
        self._series = series
        self._clock = clock
        self._deliver = deliver if deliver is not None else self._over_zmq
        self._ids = itertools.count(1)
        self._pinned: set[PrefixId] = set()
        self._copies: dict[PrefixId, set[Tier]] = {}
        self._outcomes: Counter[tuple[str, str]] = Counter()
        self._rounds = 0
        self._failures = 0
        self._last_error = ""
        self._last_rejection = ""
        self._task: asyncio.Task[None] | None = None

    # -- inputs ----------------------------------------------------------------------------------

    def observe(self, rec: RequestRecord) -> None:
        """A request ended (`RouterMetrics.on_request`): track its prefix on its worker."""
        if rec.decision is not None:
            self.track(rec.decision)

    def track(self, d: Decision) -> None:
        """Track the prefix of a placed request on its worker, now (by the runner's clock)."""
        self.tracker.record(d.namespace, d.keys, d.worker.name, d.matched_blocks, self._clock())

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="tiering")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            await self.round()

    # -- one round -------------------------------------------------------------------------------

    async def snapshot(self) -> TierState:
        """What the policy sees now. Matching walks each tracked chain in the index (an index
        with an LRU bound counts that as a use, as it does for placement)."""
        stats = await self._index.stats()
        per_worker: dict[str, dict[Tier, int]] = {}
        for (worker, tier), n in stats.entries_by_worker_tier.items():
            per_worker.setdefault(worker, {})[tier] = n
        workers = {
            w.name: WorkerState(
                w.name,
                w.pool.name,
                w.snapshot.kv_usage if w.snapshot is not None else 0.0,
                block_bytes(w),
                tier_bytes(w, per_worker.get(w.name, {})),
                bool(w.config.control),
            )
            for w in self._workers.values()
        }
        prefixes: list[PrefixState] = []
        for pid, tracked in self.tracker.items():
            namespace, head, name = pid
            seen = workers.get(name)
            if seen is None or not tracked.keys:
                continue
            match = (await self._index.match(tracked.keys, [name]))[name]
            if not match.blocks and not self._index.outage.down:
                self._pinned.discard(pid)  # gone from the engine (evicted, restarted): no pin
            prefixes.append(
                PrefixState(
                    namespace,
                    head,
                    name,
                    tuple(tracked.keys),
                    tracked.requests,
                    tuple(tracked.hit_times),
                    tracked.last_use,
                    dict(match.by_tier),
                    seen.block_bytes,
                    pid in self._pinned,
                    frozenset(self._copies.get(pid, ())),
                )
            )
        return TierState(self._clock(), prefixes, workers)

    async def round(self) -> None:
        """One policy round: snapshot, decide, send, count. Skipped while the index store
        cannot answer: its empty matches then say nothing about what the workers hold."""
        state = await self.snapshot()
        if self._index.outage.down:
            return
        self._rounds += 1
        self._series.tiering_rounds.inc()
        try:
            actions = list(self.policy.decide(state))
            if not all(isinstance(a, Action) for a in actions):
                raise TypeError("decide() must return router.tiering.Action items")
        except Exception as exc:  # a user policy must never stop the router
            _log.exception("tier policy %r failed", self.policy.name)
            self._failures += 1
            self._last_error = f"{type(exc).__name__}: {exc}"
            self._series.tiering_failures.inc()
            return
        cap = self.config.max_directives
        for action in actions[cap:]:
            self._count(action.kind, "dropped")
        await asyncio.gather(*(self._send(a) for a in actions[:cap]))

    async def _over_zmq(self, worker_name: str, directive: Directive) -> DirectiveAck | None:
        """The router's delivery: the worker's plugin control socket."""
        worker = self._workers.get(worker_name)
        endpoint = worker.config.control if worker is not None else None
        if not endpoint:
            return None
        return await send_directive(
            endpoint, directive, self.config.directive_timeout_s, self._token
        )

    async def _send(self, action: Action) -> None:
        directive = action.directive(f"tier-{next(self._ids)}")
        try:
            ack = await self._deliver(action.worker, directive)
        except TimeoutError:
            self._count(action.kind, "timeout")
            return
        except (zmq.ZMQError, OSError) as exc:
            _log.warning("directive to %s failed: %s", action.worker, exc)
            self._count(action.kind, "error")
            return
        if ack is None:
            self._count(action.kind, "no_control")
            return
        if not ack.applied:
            self._last_rejection = f"{action.kind.value} on {action.worker}: {ack.reason}"
            self._count(action.kind, "rejected")
            return
        self._count(action.kind, "applied")
        self._mark(action)

    def _mark(self, action: Action) -> None:
        """Remember what an applied directive changed, for the next snapshots."""
        pid = action.prefix
        if pid is None:
            return
        if action.kind is DirectiveKind.PIN:
            self._pinned.add(pid)
        elif action.kind is DirectiveKind.UNPIN:
            self._pinned.discard(pid)
        elif action.kind is DirectiveKind.OFFLOAD and action.tier is not None:
            self._copies.setdefault(pid, set()).add(action.tier)
        elif action.kind is DirectiveKind.EVICT:
            self._pinned.discard(pid)

    def _count(self, kind: DirectiveKind, outcome: str) -> None:
        self._outcomes[(kind.value, outcome)] += 1
        self._series.tiering_directives.labels(kind.value, outcome).inc()

    # -- reading ---------------------------------------------------------------------------------

    def stats(self) -> TieringStats:
        directives: dict[str, dict[str, int]] = {}
        for (kind, outcome), n in sorted(self._outcomes.items()):
            directives.setdefault(kind, {})[outcome] = n
        return TieringStats(
            policy=self.policy.name,
            rounds=self._rounds,
            policy_failures=self._failures,
            last_error=self._last_error,
            directives=directives,
            last_rejection=self._last_rejection,
            tracked_prefixes=len(self.tracker),
            pinned_prefixes=len(self._pinned),
        )
