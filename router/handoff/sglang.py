"""SGLang's P/D hand-off (0.5.23): the prefill and the decode worker get the same body, with
`bootstrap_host` / `bootstrap_port` (the prefill worker's bootstrap server) and one random
`bootstrap_room` naming the transfer, at the same time; the decode worker's answer is the
client's. That is what SGLang's own load balancer sends (sglang-router 0.3.2,
`sglang_router/mini_lb.py`: scalar fields on /v1/completions and /v1/chat/completions); the
fields are SGLang's `PDRoutingFields` (srt/entrypoints/openai/protocol.py) and
`GenerateReqInput.bootstrap_*` (srt/managers/io_struct.py)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import msgspec

from router.config import WorkerConfig

BOOTSTRAP_PORT = 8998
"""SGLang 0.5.23's `--disaggregation-bootstrap-port` default (srt/arg_groups/fields/disagg.py).
Always sent: a request without one gets the *decode* server's own setting
(`Scheduler._handle_generate_request`, srt/managers/scheduler.py)."""
_ROOMS = 2**63 - 2**20
"""Rooms are drawn below this: SGLang gives a batch's (or `n` > 1's) sequences rooms
room + i (`GenerateReqInput._normalize_bootstrap_params`), which must stay int64."""


def leg_body(body: Mapping[str, Any], prefill: WorkerConfig) -> dict[str, Any]:
    """The body both legs get: the client's (as the proxy rewrote it) with the bootstrap host
    and port of `prefill`'s worker and a new room (scalars, as the mini LB sends on the OpenAI
    routes; SGLang spreads them over a batch's or `n` > 1's sequences itself)."""
    return {
        **body,
        "bootstrap_host": prefill.bootstrap_host or urlsplit(prefill.url).hostname,
        "bootstrap_port": prefill.bootstrap_port or BOOTSTRAP_PORT,
        "bootstrap_room": secrets.randbelow(_ROOMS),
    }


def answer_usage(raw: bytes) -> dict[str, Any] | None:
    """The `usage` block of an OpenAI answer, JSON or SSE (the prefill leg is sent the client's
    body, so it streams when the client does)."""
    try:
        if not raw.startswith(b"data:"):
            parsed = msgspec.json.decode(raw)
            usage = parsed.get("usage") if isinstance(parsed, dict) else None
            return usage if isinstance(usage, dict) else None
        found = None
        for event in raw.split(b"\n\n"):
            if event.startswith(b"data: {") and b'"usage"' in event:
                parsed = msgspec.json.decode(event[6:])
                if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
                    found = parsed["usage"]
        return found
    except msgspec.DecodeError:
        return None
