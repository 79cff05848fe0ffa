"""`warply where PROMPT`: which workers hold how much of a prompt on which tier, and what the
router would choose and why (`/warply/where`), as a table per pool."""

from __future__ import annotations

import argparse
import json

import msgspec
from rich.console import Console
from rich.table import Table

from warply.cli.admin import add_router_args, call
from warply.protocol.api import PoolWhere, Where


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `where` verb."""
    w = sub.add_parser(
        "where",
        help="where a prompt's prefix lives (workers, tiers) and what the router would choose",
        description="Ask a running router where PROMPT's prefix is cached: per worker, the "
        "leading blocks it holds by tier and the cached tokens its engine would report, and "
        "its strategy's score; then the worker the router would choose. Nothing is booked.",
    )
    w.add_argument("prompt", help="the prompt text (a user message with --chat)")
    w.add_argument("--chat", action="store_true", help="send PROMPT as one chat user message")
    w.add_argument("--model", help="the served model or LoRA adapter (default: the router's)")
    w.add_argument("--cache-key", help="the request's cache namespace (extra_body warply)")
    w.add_argument("--json", action="store_true", help="print the router's JSON answer")
    add_router_args(w)
    w.set_defaults(func=_where)


def _where(args: argparse.Namespace) -> int:
    body: dict[str, object] = (
        {"messages": [{"role": "user", "content": args.prompt}]}
        if args.chat
        else {"prompt": args.prompt}
    )
    if args.model:
        body["model"] = args.model
    if args.cache_key is not None:
        body["warply"] = {"cache_key": args.cache_key}
    answer = call(args, "/warply/where", Where, body)
    if args.json:
        print(json.dumps(msgspec.to_builtins(answer), indent=2))
        return 0
    console = Console()
    namespace = f"namespace {answer.namespace!r}" if answer.namespace else "no namespace"
    console.print(
        f"prompt: {answer.prompt_tokens} tokens, {namespace}; router strategy {answer.strategy}"
    )
    for pool in answer.pools:
        console.print(_table(pool))
    choice = answer.choice
    if choice is None:
        console.print(f"[bold red]no worker would take it[/]: {answer.unavailable}")
        return 0
    how = choice.mode
    if choice.prefill_worker:
        how += f", prefilled on {choice.prefill_worker}"
    elif choice.local_reason:
        how += f": {choice.local_reason}"
    console.print(
        f"[bold]choice: {choice.worker}[/] ({how}), "
        f"{choice.predicted_cached_tokens} of {answer.prompt_tokens} prompt tokens cached"
    )
    return 0


def _table(pool: PoolWhere) -> Table:
    title = (
        f"pool {pool.name} ({pool.role}, {pool.strategy}, block {pool.block_size}, "
        f"{pool.prompt_blocks} prompt blocks)"
    )
    table = Table(title=title, title_justify="left")
    for column in ("worker", "blocks", "cached tokens", "by tier", "rule", "score", "terms"):
        table.add_column(column)
    for w in pool.workers:
        name = w.name + (" ←" if w.name == pool.pick else "")
        name += "" if w.available else " (unavailable)"
        tiers = " ".join(f"{tier}:{n}" for tier, n in w.blocks_by_tier.items()) or "-"
        score = w.score
        table.add_row(
            name,
            str(w.blocks),
            str(w.cached_tokens),
            tiers,
            score.rule if score else "-",
            ", ".join(f"{x:.4g}" for x in score.key) if score else "-",
            " ".join(f"{k}={v:.4g}" for k, v in score.terms.items()) if score else "-",
        )
    return table
