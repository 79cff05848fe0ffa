"""`warply stats`: the router's cache statistics (`/warply/cache_stats`) as terminal tables:
hit rate, bytes by tier, TTFT, per pool and worker, the affinity map; `--watch` keeps them live."""

from __future__ import annotations

import argparse
import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from warply.cli.admin import add_router_args, call
from warply.common.argtypes import non_negative, positive
from warply.protocol.api import CacheStats, Quantiles


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `stats` verb."""
    s = sub.add_parser(
        "stats",
        help="the router's cache statistics as tables (hit rate, bytes by tier, affinity, TTFT)",
        description="Read /warply/cache_stats from a running router and print it as tables; "
        "with --watch, refresh them every --interval seconds until Ctrl-C (or --count).",
    )
    add_router_args(s)
    s.add_argument("--watch", action="store_true", help="keep the tables live")
    s.add_argument(
        "--interval", type=positive(float), default=2.0, help="seconds between refreshes (2)"
    )
    s.add_argument(
        "--count", type=non_negative(int), default=0, help="with --watch: stop after N refreshes"
    )
    s.add_argument(
        "--affinity", type=non_negative(int), default=10, help="affinity rows shown (default 10)"
    )
    s.set_defaults(func=_stats)


def _stats(args: argparse.Namespace) -> int:
    console = Console()
    if not args.watch:
        console.print(render(call(args, "/warply/cache_stats", CacheStats), args.affinity))
        return 0
    shown = 0
    try:
        with Live(console=console, auto_refresh=False) as live:
            while True:
                stats = call(args, "/warply/cache_stats", CacheStats)
                live.update(render(stats, args.affinity), refresh=True)
                shown += 1
                if args.count and shown >= args.count:
                    return 0
                time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def render(stats: CacheStats, affinity: int) -> Group:
    """Every table for one `CacheStats`."""
    hit = stats.hit_rate
    index = stats.index
    summary = Table(title=f"warply router: strategy {stats.strategy}", title_justify="left")
    for column in ("requests", "hit rate (engine)", "hit rate (predicted)", "window (engine)",
                   "bytes cached", "TTFT p50 / p99", "overhead p50 / p99", "alert"):  # fmt: skip
        summary.add_column(column)
    summary.add_row(
        str(stats.requests), _ratio(hit.engine), _ratio(hit.predicted),
        _ratio(hit.window_engine), _bytes(index.bytes_cached), _seconds(stats.ttft_s),
        _seconds(stats.overhead_s),
        f"firing (< {stats.alert.min_hit_ratio:.0%})" if stats.alert.firing else "ok",
    )  # fmt: skip
    tiers = Table(title="bytes by tier", title_justify="left")
    for column in ("tier", "entries", "bytes"):
        tiers.add_column(column)
    for tier, size in index.bytes_by_tier.items():
        tiers.add_row(tier, str(index.entries_by_tier.get(tier, 0)), _bytes(size))
    pools = Table(title="pools", title_justify="left")
    for column in ("pool", "role", "requests", "prompt tokens", "hit rate", "bytes",
                   "evictions", "hand-offs"):  # fmt: skip
        pools.add_column(column)
    for name, p in stats.pools.items():
        pools.add_row(
            name, p.role, str(p.requests), str(p.prompt_tokens), _ratio(p.hit_rate),
            _bytes(index.bytes_by_pool.get(name, 0)), str(stats.evictions_by_pool.get(name, 0)),
            str(p.handoffs),
        )  # fmt: skip
    workers = Table(title="workers", title_justify="left")
    for column in ("worker", "healthy", "in flight", "requests", "prompt tokens",
                   "engine cached", "hit rate", "engine prefix hits"):  # fmt: skip
        workers.add_column(column)
    for name, w in stats.workers.items():
        rate = w.engine_cached_tokens / w.prompt_tokens if w.prompt_tokens else None
        workers.add_row(
            name, "yes" if w.healthy else "no", str(w.in_flight), str(w.requests),
            str(w.prompt_tokens), str(w.engine_cached_tokens), _ratio(rate),
            str(w.engine_prefix_hits),
        )  # fmt: skip
    parts: list[Table] = [summary, tiers, pools, workers]
    if affinity and stats.affinity:
        table = Table(title="affinity (busiest prefixes)", title_justify="left")
        for column in ("namespace", "first block", "requests by worker"):
            table.add_column(column)
        for entry in stats.affinity[:affinity]:
            spread = " ".join(f"{w}:{n}" for w, n in entry.workers.items())
            table.add_row(entry.namespace or "-", entry.first_block, spread)
        parts.append(table)
    return Group(*parts)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _seconds(q: Quantiles) -> str:
    if q.p50 is None or q.p99 is None:
        return "-"
    return f"{q.p50 * 1000:.0f} / {q.p99 * 1000:.0f} ms"


def _bytes(n: int) -> str:
    size, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
