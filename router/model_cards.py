"""The engines' `/v1/models` cards, read at start-up for the context limit prompts are checked
against (`max_model_len`, which vLLM puts on its base model's card)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Annotated

import aiohttp
import msgspec

from router.workers import Worker

_log = logging.getLogger("warply.router")
_TIMEOUT = aiohttp.ClientTimeout(total=2)


class _Card(msgspec.Struct):
    id: str
    max_model_len: Annotated[int, msgspec.Meta(gt=0)] | None = None


class _Cards(msgspec.Struct):
    data: list[_Card]


async def context_limit(
    session: aiohttp.ClientSession, workers: Iterable[Worker], model: str
) -> int | None:
    """`max_model_len` of `model`'s card, from the first healthy worker whose /v1/models
    answers in vLLM's shape (None: none does). A worker that lists other models only is
    logged: every request the router sends it would be refused."""
    for w in workers:
        if not w.healthy:
            continue
        try:
            async with session.get(w.config.url + "/v1/models", timeout=_TIMEOUT) as resp:
                cards = msgspec.json.decode(await resp.read(), type=_Cards).data
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError):
            continue
        mine = [c.max_model_len for c in cards if c.id == model]
        if not mine:
            served = ", ".join(repr(c.id) for c in cards) or "none"
            _log.warning("worker %s serves %s, not %r (the router's model)", w.name, served, model)
            continue
        limits = [n for n in mine if n is not None]
        if limits:
            return min(limits)
    return None
