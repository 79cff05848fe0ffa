"""`warply bench live`: replay against an OpenAI-compatible endpoint (a local stub here)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from replay.__main__ import main as replay_main
from replay.live import LiveConfig, run_live
from replay.trace import TraceRequest


class _Stub(BaseHTTPRequestHandler):
    """Streams one chunk per requested token and reports half the prompt as cached."""

    prompts: list[list[int]] = []

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "stub-model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["model"] == "stub-model" and req["stream"]
        _Stub.prompts.append(req["prompt"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(req["max_tokens"]):
            self.wfile.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        usage = {"prompt_tokens_details": {"cached_tokens": len(req["prompt"]) // 2}}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture()
def stub_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_live_replay_measures_ttft_itl_and_reuse(stub_url: str) -> None:
    reqs = [TraceRequest(100.0 * i, 600, 5, (1, 2 + i)) for i in range(4)]
    cfg = LiveConfig(url=stub_url, speedup=100.0, vocab=1000, max_prompt_tokens=520)
    row = run_live(reqs, 512, cfg, quiet=True)
    assert row["requests"] == 4 and row["errors"] == 0
    assert row["ttft_mean_ms"] > 0 and row["itl_mean_ms"] >= 0
    assert row["reuse"] == pytest.approx(0.5, abs=0.01)
    prompts = _Stub.prompts[-4:]
    assert all(len(p) == 520 and max(p) < 1000 for p in prompts)
    assert len({tuple(p[:512]) for p in prompts}) == 1  # equal hash ids, equal tokens


def test_live_replay_refuses_remote_hosts_and_bad_urls() -> None:
    with pytest.raises(ValueError, match="loopback"):
        LiveConfig(url="http://10.1.2.3:8000")
    assert LiveConfig(url="http://10.1.2.3:8000", allow_remote=True).allow_remote
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        LiveConfig(url="ftp://127.0.0.1")
    with pytest.raises(ValueError, match="Port out of range"):
        LiveConfig(url="http://127.0.0.1:99999")


@pytest.mark.parametrize(
    ("url", "code", "error"),
    [
        ("http://10.1.2.3:8000", 2, "url: 10.1.2.3 is not a loopback address (pass --allow-"),
        ("http://127.0.0.1:99999", 2, "url: Port out of range 0-65535"),
        ("http://127.0.0.1:{refused}", 1, "cannot reach http://127.0.0.1:{refused}: "),
    ],
)
def test_live_command_reports_a_bad_or_dead_endpoint_in_one_line(
    url: str, code: int, error: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each was a traceback: the loopback check and the port ran outside the settings'
    validation, and the served-model question was not guarded."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused = s.getsockname()[1]
    url, error = url.format(refused=refused), error.format(refused=refused)
    trace = tmp_path / "trace.jsonl"
    row = {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}
    trace.write_text(json.dumps(row) + "\n")
    assert replay_main(["live", "--url", url, str(trace), "--quiet"]) == code
    err = capsys.readouterr().err
    assert err.startswith("warply bench live: ") and error in err and "Traceback" not in err


def test_live_replay_stops_at_its_deadline(stub_url: str) -> None:
    reqs = [TraceRequest(0.0, 100, 2, (1,)), TraceRequest(3_600_000.0, 100, 2, (2,))]
    row = run_live(reqs, 512, LiveConfig(url=stub_url, timeout_s=2.0), quiet=True)
    assert row["requests"] == 1
