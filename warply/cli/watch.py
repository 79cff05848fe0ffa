"""`warply watch ENDPOINT`: print a worker's decoded state stream as JSON lines."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections import Counter
from typing import Any

from warply.common.argtypes import non_negative
from warply.protocol.endpoints import endpoint_arg
from warply.protocol.plugin import LOCAL_EVENTS_ENDPOINT, LOCAL_REPLAY_ENDPOINT


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `watch` verb."""
    w = sub.add_parser(
        "watch",
        help="print a worker's decoded state stream (Warply plugin or stock vLLM/SGLang events)",
        description="Subscribe to a state stream and print each event as one JSON line; "
        "a summary line with counts, gaps and rejections ends the output.",
    )
    w.add_argument(
        "endpoint",
        nargs="?",
        type=endpoint_arg,  # the replay socket opens at the first gap: checked here, not there
        help="ZMQ endpoint of the stream (default: an engine on this host with the default "
        f"endpoints, {LOCAL_EVENTS_ENDPOINT}, replay {LOCAL_REPLAY_ENDPOINT})",
    )
    w.add_argument(
        "--bind",
        action="store_true",
        help="bind the endpoint (for engines configured to connect to a collector)",
    )
    w.add_argument(
        "--replay", metavar="ENDPOINT", type=endpoint_arg, help="the publisher's replay endpoint"
    )
    w.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    w.add_argument("--name", default="worker", help="worker name used in logs")
    w.add_argument("--tokens", action="store_true", help="print token ids in full")
    w.add_argument(
        "--count", type=non_negative(int), default=0, help="stop after this many events (0: never)"
    )
    w.add_argument(
        "--duration",
        type=non_negative(float),
        default=0.0,
        help="stop after this many seconds (0: never)",
    )
    w.set_defaults(func=_watch)


def _watch(args: argparse.Namespace) -> int:
    """Subscribe to one state stream and print each decoded event as a JSON line."""
    import msgspec

    from warply.protocol import DecodedBatch
    from warply.protocol.subscriber import StateSubscriber

    if args.endpoint is None:
        args.endpoint = LOCAL_EVENTS_ENDPOINT
        args.replay = args.replay or LOCAL_REPLAY_ENDPOINT
    counts: Counter[str] = Counter()

    async def on_batch(worker: str, batch: DecodedBatch) -> None:
        for ev in batch.events:
            kind = type(ev).__name__
            counts[kind] += 1
            line: dict[str, Any] = {"seq": batch.seq, "source": batch.source, "event": kind}
            # events are array-like structs on the wire: name their fields here
            line.update({f: msgspec.to_builtins(getattr(ev, f)) for f in ev.__struct_fields__})
            if not args.tokens and "token_ids" in line:
                line["token_ids"] = f"<{len(line['token_ids'])} tokens>"
            print(json.dumps(line), flush=True)
        if args.count and sum(counts.values()) >= args.count:
            raise asyncio.CancelledError

    async def on_stale(worker: str) -> None:
        print(json.dumps({"event": "stale", "worker": worker}), flush=True)

    sub = StateSubscriber(
        args.name,
        args.endpoint,
        on_batch,
        on_stale,
        replay_endpoint=args.replay,
        topic=args.topic.encode(),
        bind=args.bind,
    )

    async def run() -> None:
        task = asyncio.create_task(sub.run())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        if args.duration:
            loop.call_later(args.duration, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass

    try:
        sub.open()
    except Exception as exc:  # zmq.ZMQError: bad endpoint, address in use
        print(f"warply watch: cannot open {args.endpoint}: {exc}", file=sys.stderr)
        return 2
    asyncio.run(run())
    summary = {
        "event": "summary",
        "counts": dict(counts),
        "gaps": sub.gaps,
        "replayed": sub.replayed,
        "resyncs": sub.resyncs,
        "rejected": {str(k): v for k, v in sub.decoder.rejected.items()},
    }
    print(json.dumps(summary), flush=True)
    return 0
