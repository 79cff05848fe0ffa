"""`warply watch` against the project's real state publisher (the one both plugins use): each
event comes out as one JSON line with its fields named, then a summary line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from warply.protocol import BlockRemoved, BlockStored, LoadSnapshot, Tier
from warply.protocol.publisher import StatePublisher

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_watch_prints_each_event_with_named_fields() -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    watch = subprocess.Popen(
        [sys.executable, "-m", "warply", "watch", endpoint, "--bind", "--count", "3",
         "--duration", "60"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    publisher = StatePublisher(endpoint, worker="w0", bind=False)
    try:
        events = [
            BlockStored([11, 12], None, list(range(8)), 4, tier=Tier.CPU),
            BlockRemoved([11]),
            LoadSnapshot(running=1, waiting=2, kv_usage=0.5, kv_bytes_per_block=4096),
        ]
        deadline = time.monotonic() + 30
        while watch.poll() is None and time.monotonic() < deadline:
            publisher.publish(events)  # until the subscription is live: early batches drop
            time.sleep(0.2)
        out, err = watch.communicate(timeout=30)
    finally:
        publisher.close()
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 0, err
    assert "Traceback" not in err
    lines = [json.loads(line) for line in out.splitlines()]
    # batches before the subscription was live are missed: a gap without a replay endpoint
    stored, removed, snap = [x for x in lines if x["event"] not in ("stale", "summary")][:3]
    assert stored["event"] == "BlockStored" and stored["block_hashes"] == [11, 12]
    assert stored["tier"] == "cpu" and stored["token_ids"] == "<8 tokens>"
    assert removed == {**removed, "event": "BlockRemoved", "block_hashes": [11]}
    assert snap["event"] == "LoadSnapshot" and snap["kv_bytes_per_block"] == 4096
    assert lines[-1]["event"] == "summary" and sum(lines[-1]["counts"].values()) >= 3


def _watch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "warply", "watch", *args, "--duration", "5"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_bad_endpoints_are_usage_errors_before_any_socket() -> None:
    """A bad replay endpoint was a traceback at the first gap (the replay socket opens then); a
    port out of range went unnoticed."""
    for args, error in [
        (("--replay", "nowhere"), "argument --replay: 'nowhere' is not a ZMQ endpoint"),
        (("nowhere",), "argument endpoint: 'nowhere' is not a ZMQ endpoint"),
        (("tcp://127.0.0.1:99999", "--bind"), "port 99999 out of range in 'tcp://127.0.0.1:99999'"),
    ]:
        out = _watch(*args)
        assert out.returncode == 2 and error in out.stderr and "Traceback" not in out.stderr
        assert out.stdout == ""


def test_an_address_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        out = _watch(endpoint, "--bind")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"warply watch: cannot open {endpoint}: ")
