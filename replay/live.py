"""Live replay: send a trace to a running OpenAI-compatible endpoint with real timing.

Each request goes to `POST {url}/v1/completions` at (trace timestamp / speedup) after the start,
with the trace's token ids as the prompt (`request_tokens`, ids < vocab), `max_tokens` =
output_length, `ignore_eos` and `stream`. TTFT is the time to the first streamed chunk, ITL the
mean gap between chunks after it, reuse `usage.prompt_tokens_details.cached_tokens / prompt`
where the server reports it (vLLM: `--enable-prompt-tokens-details`). The run is bounded: at most
`concurrency` open requests, nothing is sent after `timeout_s`, every socket has a timeout, and
only loopback URLs are accepted unless `allow_remote`.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from replay.report import latency_fields
from replay.trace import TraceRequest, request_tokens
from warply.common.urls import check_http_url


class LiveConfig(BaseModel):
    """Where and how fast to replay (validated; see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    allow_remote: bool = False
    url: str
    model: str = ""
    speedup: float = Field(1.0, gt=0)
    concurrency: int = Field(64, gt=0)
    timeout_s: float = Field(600.0, gt=0)
    max_output_tokens: int | None = Field(None, gt=0)
    max_prompt_tokens: int | None = Field(None, gt=0)
    vocab: int = Field(32000, ge=2)

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str, info: ValidationInfo) -> str:
        """An http URL with a valid port, on loopback unless `allow_remote` (tests and benches
        stay local; the field comes first so that it is known here)."""
        host = urlsplit(check_http_url(url, ("http",))).hostname or ""
        if not info.data.get("allow_remote") and not _loopback(host):
            raise ValueError(f"{host} is not a loopback address (pass --allow-remote)")
        return url.rstrip("/")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class LiveError(Exception):
    """The endpoint could not be asked which model it serves."""


@dataclass(slots=True)
class _Outcome:
    prompt: int
    output: int
    ttft_ms: float = -1.0
    itl_ms: float = -1.0
    cached: int = 0
    error: str = ""


def _connection(cfg: LiveConfig, timeout: float) -> http.client.HTTPConnection:
    parts = urlsplit(cfg.url)
    return http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=timeout)


def _served_model(cfg: LiveConfig) -> str:
    """The first model `GET /v1/models` lists; `LiveError` when there is no such answer."""
    conn = _connection(cfg, 10.0)
    try:
        conn.request("GET", "/v1/models")
        body = json.loads(conn.getresponse().read())
        name = body["data"][0]["id"]
    except (OSError, http.client.HTTPException) as exc:
        raise LiveError(f"cannot reach {cfg.url}: {exc}") from None
    except (ValueError, LookupError, TypeError):
        raise LiveError(f"{cfg.url}/v1/models names no model (pass --model)") from None
    finally:
        conn.close()
    return str(name)


def _send(cfg: LiveConfig, model: str, prompt: list[int], max_tokens: int) -> _Outcome:
    out = _Outcome(len(prompt), 0)
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
    }
    conn = _connection(cfg, min(cfg.timeout_s, 120.0))
    start = time.perf_counter()
    stamps: list[float] = []
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(payload), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return out
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk: dict[str, Any] = json.loads(line[5:])
            if chunk.get("choices"):
                stamps.append(time.perf_counter())
            usage = chunk.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            out.cached = int(details.get("cached_tokens") or out.cached)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    out.output = len(stamps)
    if stamps:
        out.ttft_ms = (stamps[0] - start) * 1000
    if len(stamps) > 1:
        out.itl_ms = (stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1)
    return out


def run_live(
    requests: list[TraceRequest], trace_block: int, cfg: LiveConfig, quiet: bool = False
) -> dict[str, Any]:
    """Replay `requests` against `cfg.url`; one report row (the `report.summarize` keys)."""
    from tqdm import tqdm

    model = cfg.model or _served_model(cfg)
    t0 = time.perf_counter()
    deadline = t0 + cfg.timeout_s
    base = requests[0].arrival_ms
    outcomes: list[_Outcome] = []
    lock = threading.Lock()
    bar = tqdm(total=len(requests), desc=f"live {cfg.url}", disable=quiet)

    def one(req: TraceRequest) -> None:
        due = t0 + (req.arrival_ms - base) / 1000 / cfg.speedup
        if due > deadline:
            return
        time.sleep(max(0.0, due - time.perf_counter()))
        n_prompt = min(req.input_length, cfg.max_prompt_tokens or req.input_length)
        prompt = request_tokens(req, trace_block, cfg.vocab, 0, n_prompt).tolist()
        outcome = _send(
            cfg, model, prompt, min(req.output_length, cfg.max_output_tokens or 1 << 30)
        )
        with lock:
            outcomes.append(outcome)
            bar.update()

    with ThreadPoolExecutor(cfg.concurrency) as pool:
        list(pool.map(one, requests))
    bar.close()
    return _summary(cfg, outcomes, time.perf_counter() - t0)


def _summary(cfg: LiveConfig, outcomes: list[_Outcome], wall_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if not o.error and o.ttft_ms >= 0]
    prompt = sum(o.prompt for o in ok)
    return {
        "strategy": f"live {cfg.url}",
        "workers": "-",
        "requests": len(ok),
        "errors": len(outcomes) - len(ok),
        "first_error": next((o.error for o in outcomes if o.error), ""),
        "reuse": sum(o.cached for o in ok) / prompt if prompt else 0.0,
        "vs_pooled_lru": None,
        **latency_fields([o.ttft_ms for o in ok], [o.itl_ms for o in ok if o.itl_ms >= 0]),
        "throughput_tok_s": sum(o.output for o in ok) / wall_s if wall_s else 0.0,
        "imbalance": None,
        "preemptions": None,
        "decision_mean_us": None,
        "wall_s": wall_s,
        "cpu_s": None,
    }
