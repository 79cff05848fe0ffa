"""The engines' `/v1/models` cards, read at start-up: the context limit prompts are checked
against (`max_model_len`, which vLLM puts on its base model's card) and which engine serves
(`owned_by`: "vllm" or "sglang"), which decides how a Responses input is tokenized
(`router.responses`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated

import aiohttp
import msgspec

from router.workers import Worker

_log = logging.getLogger("warply.router")
_TIMEOUT = aiohttp.ClientTimeout(total=2)


class _Card(msgspec.Struct):
    id: str
    max_model_len: Annotated[int, msgspec.Meta(gt=0)] | None = None
    owned_by: str | None = None


class _Cards(msgspec.Struct):
    data: list[_Card]


@dataclass(frozen=True, slots=True)
class Served:
    """What the engines' cards say of the router's model."""

    max_model_len: int | None = None
    """The smallest `max_model_len` on its cards (None: no card has one)."""
    engine: str | None = None
    """The `owned_by` of the first card of it (vLLM: "vllm", SGLang: "sglang")."""


async def read_cards(
    session: aiohttp.ClientSession, workers: Iterable[Worker], model: str
) -> Served:
    """`model`'s cards, from the first healthy worker whose /v1/models answers in vLLM's shape
    with a card of it that has a limit (the engine from the first card of it). A worker that
    lists other models only is logged: every request the router sends it would be refused."""
    engine = None
    for w in workers:
        if not w.healthy:
            continue
        try:
            async with session.get(w.config.url + "/v1/models", timeout=_TIMEOUT) as resp:
                cards = msgspec.json.decode(await resp.read(), type=_Cards).data
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError):
            continue
        mine = [c for c in cards if c.id == model]
        if not mine:
            served = ", ".join(repr(c.id) for c in cards) or "none"
            _log.warning("worker %s serves %s, not %r (the router's model)", w.name, served, model)
            continue
        engine = engine or mine[0].owned_by
        limits = [c.max_model_len for c in mine if c.max_model_len is not None]
        if limits:
            return Served(min(limits), engine)
    return Served(None, engine)
