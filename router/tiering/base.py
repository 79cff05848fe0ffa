"""The tier-policy contract: a `TierPolicy` turns a `TierState` into `Action`s, which the runner
sends to the workers' plugins as directives.

Contract, method by method:

    name          class attribute; the name `tiering.policy.name` selects.
    Knobs         a pydantic model (extra fields forbidden): the policy's settings, validated
                  when the router starts; errors name the field (`tiering.policy.knobs.k: ...`).
    __init__(knobs)
                  called once per router with validated knobs (None: the defaults). A policy
                  may keep state across rounds on `self` (e.g. what it already asked for).
    decide(state) called every `tiering.interval_s` seconds on the router's event loop with a
                  fresh snapshot; returns the actions for this round (empty: nothing to do). It
                  must not block (no I/O) and should be quick: placement shares the loop. An
                  exception is logged and counted (`warply_tiering_policy_failures_total`); the
                  round's actions are dropped and routing goes on. Actions for workers without a
                  control endpoint are counted as `no_control` and not sent; at most
                  `tiering.max_directives` are sent per round (the rest counted as `dropped`).

Every action becomes one `warply.protocol.Directive`; its ack (applied or rejected with the
plugin's reason), a timeout or an unreachable worker is counted per kind and outcome, and the
next snapshot shows pins and copies that were applied.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from router.tiering.state import PrefixState, TierState
from warply.protocol import Directive, DirectiveKind, Tier


class Knobs(BaseModel):
    """Base of every policy's knobs: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True, slots=True)
class Action:
    """One directive a policy wants sent to one worker."""

    worker: str
    kind: DirectiveKind
    keys: tuple[int, ...] = ()
    tier: Tier | None = None
    namespace: str = ""
    ttl_s: float = 0.0
    quota_bytes: int | None = None
    prefix: tuple[str, int, str] | None = None
    """The tracked prefix it is about (the runner keeps its pin and copy marks)."""

    @classmethod
    def on(
        cls, kind: DirectiveKind, p: PrefixState, tier: Tier | None = None, ttl_s: float = 0.0
    ) -> Action:
        """`kind` (pin, unpin, prefetch, offload, evict) for prefix `p` on its worker."""
        return cls(p.worker, kind, p.keys, tier, p.namespace, ttl_s, prefix=p.id)

    @classmethod
    def quota(cls, worker: str, namespace: str, tier: Tier | None, quota_bytes: int) -> Action:
        """Cap `namespace`'s bytes on `tier` of `worker` (None: all tiers)."""
        return cls(worker, DirectiveKind.QUOTA, (), tier, namespace, quota_bytes=quota_bytes)

    def directive(self, directive_id: str) -> Directive:
        return Directive(
            directive_id,
            self.kind,
            keys=list(self.keys) or None,
            tier=self.tier,
            ttl_s=self.ttl_s,
            namespace=self.namespace,
            quota_bytes=self.quota_bytes,
        )


class TierPolicy(abc.ABC):
    """Decides, each round, which prefixes to pin, move or drop on which tier (see module)."""

    name: ClassVar[str]
    Knobs: ClassVar[type[BaseModel]] = Knobs

    def __init__(self, knobs: BaseModel | None = None) -> None:
        self.knobs = knobs if knobs is not None else self.Knobs()

    @abc.abstractmethod
    def decide(self, state: TierState) -> Sequence[Action]:
        """This round's actions for `state` (see the module docstring for the rules)."""


def next_tier(tier: Tier) -> Tier | None:
    """The tier below `tier` (None under object_store)."""
    order = tuple(Tier)
    i = order.index(tier)
    return order[i + 1] if i + 1 < len(order) else None


def tier_above(tier: Tier) -> Tier | None:
    """The tier above `tier` (None above gpu)."""
    order = tuple(Tier)
    i = order.index(tier)
    return order[i - 1] if i > 0 else None
