"""The plugin's LMCache client (`vllm_connector.lmcache`) against a server on 127.0.0.1 that
answers in shapes LMCache 0.5.6 never sends: each reply is an `LMCacheError` naming its call,
and the polling thread keeps polling. The real server is tested in tests/lmcache/."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from vllm_connector.lmcache import LMCacheError, LMCacheServer
from warply.protocol import Tier

_STATUS = {"chunk_size": 256, "hash_algorithm": "blake3", "storage_manager": {"l1_usage": [0, 1]}}


class _Odd(BaseHTTPRequestHandler):
    """`/status` in LMCache's shape (its L1 bytes from `used`), everything else in `replies`."""

    used = 1
    replies: dict[tuple[str, str], Any] = {}

    def _answer(self) -> None:
        path = self.path.split("?")[0]
        if path == "/status":
            body: Any = {**_STATUS, "storage_manager": {"l1_usage": [_Odd.used, 1 << 30]}}
        else:
            body = _Odd.replies.get((self.command, path), {})
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = _answer

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def odd_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Odd)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        _Odd.replies = {}


def test_odd_replies_are_lmcache_errors_and_the_polling_goes_on(
    odd_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    _Odd.replies = {
        ("GET", "/config/adapters"): {"adapters": [{"type": "s3"}]},  # no type_name
        ("DELETE", "/cache/objects"): {"ok": True},  # no deleted / skipped counts
        ("POST", "/cache/prefetches"): [3],  # not an object
    }
    server = LMCacheServer(odd_server, poll_interval_s=0.02)
    server.start()
    try:
        deadline = time.monotonic() + 10
        while server.tier_bytes is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.tier_bytes == {Tier.CPU: 1}, "L1 read, the object store left out"
        _Odd.used = 7
        while server.tier_bytes != {Tier.CPU: 7} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.tier_bytes == {Tier.CPU: 7}, "still polling after the odd replies"
        assert "GET /config/adapters: unexpected reply" in caplog.text
        with pytest.raises(LMCacheError, match="GET /config/adapters: unexpected reply"):
            server.adapter(Tier.SSD)
        server._adapters = ["s3"]
        _Odd.replies[("GET", "/cache/objects")] = {"entries": 5}
        with pytest.raises(LMCacheError, match="GET /cache/objects: unexpected reply"):
            server._listing("s3")
        keys = [{"chunk_hash_hex": "ab", "model_name": "m", "kv_rank": 0, "object_group_id": 0,
                 "cache_salt": ""}]  # fmt: skip
        server._object_keys = lambda *_: keys  # type: ignore[method-assign]
        with pytest.raises(LMCacheError, match="DELETE /cache/objects: unexpected reply"):
            server.evict(Tier.CPU, [1, 2], "", "m", 1)
        with pytest.raises(LMCacheError, match="POST /cache/prefetches: unexpected reply"):
            server.prefetch([1, 2], "", "m", 1)
    finally:
        server.close()
