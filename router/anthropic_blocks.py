"""Anthropic Messages content blocks read alike by vLLM 0.32's and SGLang 0.5's conversions of
a Messages body into a chat: a block's string field, a `tool_use` block as a tool call."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def str_field(block: Mapping[str, Any], key: str) -> str | None:
    """`block[key]` when it is a string, else None."""
    value = block.get(key)
    return value if isinstance(value, str) else None


def tool_call(block: Mapping[str, Any]) -> dict[str, Any] | None:
    """A `tool_use` block as vLLM 0.32 makes it a tool call; None without an id (vLLM names
    such a call by the clock, which no router can follow; clients echo the engine's id)."""
    call_id, name, given = str_field(block, "id"), block.get("name"), block.get("input")
    if not call_id or not (name is None or isinstance(name, str)) or not (
        given is None or isinstance(given, dict)
    ):
        return None
    arguments = json.dumps(given or {})
    return {"id": call_id, "type": "function",
            "function": {"name": name or "", "arguments": arguments}}  # fmt: skip
