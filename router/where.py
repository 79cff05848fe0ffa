"""`/warply/where`: which workers hold how much of a prompt on which tier, and what the router
would choose and why (each pool's strategy scores). Tokenized and keyed exactly as a request
(`Proxy.tokens`), placed by `Placement.explain`: nothing is booked, no strategy state moves.

    GET  /warply/where?prompt=TEXT[&model=M][&cache_key=K]
    POST /warply/where   {"prompt": ...}, {"messages": [...]} or {"input": ...} (a response),
                         with "model" and "warply" ({"cache_key", "prefix_reuse"}) as in a
                         completion request
    POST /warply/where?api=messages   an Anthropic Messages body (its "messages" are not a
                         chat completion's)
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from router.errors import ApiError, read_object
from router.placement import Explanation, Placement, PoolTrace, predicted_cached
from router.proxy import Proxy
from router.strategies import Score
from router.workers import Workers
from warply.protocol.api import PoolWhere, ScoreView, Where, WhereChoice, WorkerWhere

_QUERY = {"GET": ("prompt", "model", "cache_key"), "POST": ("api",)}
"""The query parameters each method takes: any other is refused, so that a misspelt one
(`cachekey=`) is not an answer for another tenant's namespace."""


async def request_body(request: web.Request) -> tuple[dict[str, Any], str]:
    """The completion / chat body the query or the POST body describes, and its kind."""
    known = _QUERY.get(request.method, ())
    if unknown := sorted(set(request.query) - set(known)):
        names = ", ".join(map(repr, unknown))
        msg = f"unknown query parameter {names}: {request.method} /warply/where takes " + (
            ", ".join(map(repr, known)))  # fmt: skip
        raise ApiError(400, msg, "invalid_value", unknown[0])
    if request.method == "POST":
        api = request.query.getall("api", [])
        if any(a != "messages" for a in api):
            raise ApiError(400, "'api' must be 'messages' (an Anthropic Messages body) or left out",
                           "invalid_value", "api")  # fmt: skip
        body = await read_object(request)
        if api:
            return body, "messages"
    else:
        query = request.query
        if "prompt" not in query:
            raise ApiError(400, "'prompt' is required (or POST a request body)", "invalid_prompt",
                           "prompt")  # fmt: skip
        body = {"prompt": query["prompt"]}
        if "model" in query:
            body["model"] = query["model"]
        if "cache_key" in query:
            body["warply"] = {"cache_key": query["cache_key"]}
    kind = "responses" if "input" in body else "chat" if "messages" in body else "completion"
    return body, kind


async def where(
    request: web.Request, proxy: Proxy, placement: Placement, workers: Workers, strategy: str
) -> Where:
    """What `/warply/where` serves for `request`."""
    body, kind = await request_body(request)
    tokens, namespace, reuse = await proxy.tokens(body, kind)
    explanation = await placement.explain(tokens, namespace, reuse)
    pools = [_pool(trace, workers, len(tokens)) for trace in explanation.pools]
    return Where(
        placement.model, strategy, namespace, len(tokens), reuse, _choice(explanation),
        explanation.unavailable, pools,
    )  # fmt: skip


def _choice(explanation: Explanation) -> WhereChoice | None:
    decision = explanation.decision
    if decision is None:
        return None
    leg = decision.prefill
    return WhereChoice(
        decision.worker.name, decision.mode, decision.reported_cached,
        leg.worker.name if leg is not None else None, decision.local_reason,
    )  # fmt: skip


def _pool(trace: PoolTrace, workers: Workers, prompt_tokens: int) -> PoolWhere:
    rows = []
    for name, match in trace.held.items():
        worker = workers[name]
        score = trace.scores.get(name)
        rows.append(
            WorkerWhere(
                name,
                worker.available,
                match.blocks,
                predicted_cached(match.blocks, prompt_tokens, trace.block_size),
                {tier.value: n for tier, n in match.by_tier.items()},
                _score(score) if score is not None else None,
            )
        )
    return PoolWhere(
        trace.pool, trace.role, trace.block_size, trace.strategy, len(trace.keys), trace.pick,
        rows,
    )  # fmt: skip


def _score(score: Score) -> ScoreView:
    return ScoreView(score.rule, [float(x) for x in score.key], dict(score.terms))
