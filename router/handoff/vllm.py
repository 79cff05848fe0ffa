"""vLLM's two-step hand-off over a KV connector (NixlConnector, ...): the prefill leg's body and
the decode leg's `kv_transfer_params` (vLLM 0.32's toy P/D proxy sends the same)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.accounting import cached_tokens


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: the client's, computing the prompt and one token, not streamed,
    asking the engine to keep the KV for a remote decode."""
    out = dict(body)
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def decode_params(params: Mapping[str, Any], prefill_usage: Any) -> dict[str, Any]:
    """The decode leg's `kv_transfer_params`: the prefill's, with the prefill engine's cache hit
    as `remote_prefill_cached_tokens` when the engine left it out (vLLM then reports it as the
    decode answer's cached tokens)."""
    out = dict(params)
    cached = cached_tokens(prefill_usage)
    if "remote_prefill_cached_tokens" not in out and cached is not None:
        out["remote_prefill_cached_tokens"] = cached
    return out
