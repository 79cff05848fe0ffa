"""`TierRunner`: runs the configured tier policy every `interval_s` on the router's event loop
and sends its actions to the workers' plugin control sockets (`router.control`).

Each round: snapshot (tracked prefixes → index matches, worker bytes and load) → `decide` →
at most `max_directives` directives, sent concurrently, each awaited for its ack. Outcomes are
counted per kind (Prometheus `warply_tiering_directives_total`, `cache_stats().tiering`); a
policy that raises is logged and counted, and the round ends there. Routing never waits on it.
A pin of any policy that would take its namespace past `tiering.pin_budget` (bytes pinned on
every tier and worker, `router.tiering.budget`) is refused before it is sent.

The clock and the delivery are parameters: the router uses wall time and the plugins' control
sockets; the replay (`replay.sim`) runs the same rounds in simulated time and delivers to its
simulated engines.
"""

from __future__ import annotations

import asyncio
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
from router.metrics.registry import Series, tenant_label
from router.metrics.stats import block_bytes, tier_bytes
from router.placement import Decision
from router.tasks import cancel, periodic
from router.tiering.base import Action, TierPolicy
from router.tiering.budget import PinKey, PinLedger
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
        self._pins = PinLedger(config.pin_budget)
        self._gauged: set[tuple[str, Tier]] = set()
        """(namespace, tier) pairs the pinned-bytes gauge has shown."""
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
        self._task = periodic(self.round, self.config.interval_s, "tiering")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel([self._task])

    # -- one round -------------------------------------------------------------------------------

    async def snapshot(self) -> TierState:
        """What the policy sees now. Matching walks each tracked chain in the index (an index
        with an LRU bound counts that as a use, as it does for placement)."""
        self._pins.expire(self._clock())
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
                self._pins.release(pid)  # gone from the engine (evicted, restarted): no pin
            pinned = self._pins.tiers(pid)
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
                    bool(pinned),
                    frozenset(self._copies.get(pid, ())),
                    pinned,
                )
            )
        return TierState(self._clock(), prefixes, workers)

    async def round(self) -> None:
        """One policy round: snapshot, decide, send, count. Skipped while the index store
        cannot answer: its empty matches then say nothing about what the workers hold."""
        state = await self.snapshot()
        if self._index.outage.down:
            return
        try:
            await self._decide_and_send(state)
        finally:
            self._publish_pins()

    async def _decide_and_send(self, state: TierState) -> None:
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
        sends = []
        for action in actions[:cap]:
            worker = state.workers.get(action.worker)
            block_bytes = worker.block_bytes if worker is not None else 0
            if action.kind is DirectiveKind.PIN and not self._admit(action, block_bytes):
                continue
            sends.append(self._send(action, block_bytes))
        await asyncio.gather(*sends)

    def _admit(self, action: Action, block_bytes: int) -> bool:
        """Reserve a pin's bytes under its namespace's budget, or refuse it (counted, logged)."""
        nbytes = len(action.keys) * block_bytes if action.keys and block_bytes > 0 else None
        refusal = self._pins.reserve(_pin_key(action), nbytes)
        if refusal is None:
            return True
        _log.debug(
            "pin of %d block(s) on %s for namespace %r refused: %s (budget %s bytes)",
            len(action.keys),
            action.worker,
            action.namespace,
            refusal.value,
            self.config.pin_budget.limit(action.namespace),
        )
        self._count(action.kind, "refused")
        refused = self._series.tiering_pins_refused
        self._series.child(refused, tenant_label(action.namespace), refusal.value).inc()
        return False

    async def _over_zmq(self, worker_name: str, directive: Directive) -> DirectiveAck | None:
        """The router's delivery: the worker's plugin control socket."""
        worker = self._workers.get(worker_name)
        endpoint = worker.config.control if worker is not None else None
        if not endpoint:
            return None
        return await send_directive(
            endpoint, directive, self.config.directive_timeout_s, self._token
        )

    async def _send(self, action: Action, block_bytes: int) -> None:
        outcome, ack = await self._outcome(action)
        if action.kind is DirectiveKind.PIN:
            self._settle_pin(action, outcome, ack, block_bytes)
        elif ack is not None:
            self._mark(action)

    async def _outcome(self, action: Action) -> tuple[str, DirectiveAck | None]:
        """Deliver `action` and count its outcome; with the ack when applied."""
        directive = action.directive(f"tier-{next(self._ids)}")
        ack: DirectiveAck | None = None
        try:
            ack = await self._deliver(action.worker, directive)
        except TimeoutError:
            outcome = "timeout"
        except (zmq.ZMQError, OSError) as exc:
            _log.warning("directive to %s failed: %s", action.worker, exc)
            outcome = "error"
        else:
            if ack is None:
                outcome = "no_control"
            elif not ack.applied:
                self._last_rejection = f"{action.kind.value} on {action.worker}: {ack.reason}"
                outcome = "rejected"
            else:
                outcome = "applied"
        self._count(action.kind, outcome)
        return outcome, ack if outcome == "applied" else None

    def _settle_pin(
        self, action: Action, outcome: str, ack: DirectiveAck | None, block_bytes: int
    ) -> None:
        """Turn a pin's reservation into the bytes it holds (the blocks its ack reports, at
        most one per key), or release it. A pin with no answer in time may still be applied
        by the plugin, so it keeps its whole charge (and reads as pinned) until released."""
        if ack is None and outcome != "timeout":
            self._pins.settle(_pin_key(action), None, None)
            return
        blocks = ack.blocks if ack is not None and ack.blocks > 0 else len(action.keys)
        if action.keys:
            blocks = min(blocks, len(action.keys))
        until = self._clock() + action.ttl_s if action.ttl_s > 0 else None
        self._pins.settle(_pin_key(action), blocks * block_bytes, until)

    def _mark(self, action: Action) -> None:
        """Remember what an applied directive (not a pin: `_settle_pin`) changed, for the next
        snapshots."""
        pid, tier = _pin_key(action)
        if action.kind is DirectiveKind.UNPIN:
            self._pins.release(pid, tier)
        elif action.kind is DirectiveKind.EVICT:
            self._pins.release(pid, tier)
        elif action.kind is DirectiveKind.OFFLOAD and action.tier is not None:
            if action.prefix is not None:
                self._copies.setdefault(action.prefix, set()).add(action.tier)

    def _publish_pins(self) -> None:
        """Set the pinned-bytes gauge per (namespace, tier); pairs with no pins left read 0."""
        now = self._pins.pinned_bytes()
        gauge = self._series.tiering_pinned_bytes
        for namespace, tier in self._gauged - now.keys():
            gauge.labels(tenant_label(namespace), tier.value).set(0)
        for (namespace, tier), nbytes in now.items():
            gauge.labels(tenant_label(namespace), tier.value).set(nbytes)
        self._gauged |= now.keys()

    def _count(self, kind: DirectiveKind, outcome: str) -> None:
        self._outcomes[(kind.value, outcome)] += 1
        self._series.tiering_directives.labels(kind.value, outcome).inc()

    # -- reading ---------------------------------------------------------------------------------

    def stats(self) -> TieringStats:
        directives: dict[str, dict[str, int]] = {}
        for (kind, outcome), n in sorted(self._outcomes.items()):
            directives.setdefault(kind, {})[outcome] = n
        pinned: Counter[str] = Counter()
        for (namespace, _), nbytes in self._pins.pinned_bytes().items():
            pinned[namespace] += nbytes
        return TieringStats(
            policy=self.policy.name,
            rounds=self._rounds,
            policy_failures=self._failures,
            last_error=self._last_error,
            directives=directives,
            last_rejection=self._last_rejection,
            tracked_prefixes=len(self.tracker),
            pinned_prefixes=len(self._pins),
            pinned_bytes=dict(pinned),
        )


def _pin_key(action: Action) -> PinKey:
    """The prefix and tier a pin, unpin or evict is about; an action built without a tracked
    prefix is named by its namespace, first key and worker, and no tier means the device."""
    pid = action.prefix or (action.namespace, action.keys[0] if action.keys else 0, action.worker)
    return pid, action.tier or Tier.GPU
