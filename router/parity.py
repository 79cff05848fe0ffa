"""Tokenizer parity: the engine's own tokenization of probe prompts against the router's.

The router keys a prompt from its own token ids, and ingestion keys an engine's blocks from the
token ids the engine reports, so both chains meet only when both sides tokenize alike (and use
the same block size, checked on every `BlockStored` by the feed). A wrong tokenizer folder or
chat template otherwise shows as a silent 0% hit rate. When a worker turns healthy (at start-up,
on joining, after a restart) the router asks its `/tokenize` (vLLM, SGLang) for a completion
probe and a chat probe and compares the ids with its own; a mismatch puts the worker's index in
`fallback` (`router.index_health`). An engine without `/tokenize` stays `unchecked`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import msgspec

from router.chat_shape import PromptError
from router.tokenize import RouterTokenizer

Result = Literal["ok", "mismatch", "unchecked"]
_TIMEOUT = aiohttp.ClientTimeout(total=5)
_PROMPT = "Parity probe: 1,234 cached blocks — naïve café, 東京.\n  Indented line\tand a tab."
_CHAT: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Does the router tokenize like the engine? 東京 🚀"},
    ],
    "add_generation_prompt": True,
}


class _Tokenized(msgspec.Struct):
    """What vLLM's and SGLang's `/tokenize` answer (other fields ignored)."""

    tokens: list[int]


@dataclass(frozen=True, slots=True)
class Probes:
    """The probe requests (bodies for `/tokenize`) and the router's own ids for each."""

    checks: list[tuple[dict[str, Any], list[int]]]

    @classmethod
    def build(cls, tokenizer: RouterTokenizer, model: str) -> Probes:
        """The router's ids for each probe (the chat probe only with a chat template), encoded
        whole: the chunk cache's own parity with whole encodes is checked when it loads."""
        completion = {"model": model, "prompt": _PROMPT, "add_special_tokens": True}
        checks = [(completion, tokenizer.whole(_PROMPT, True))]
        chat = {"model": model, **_CHAT}
        try:
            checks.append((chat, tokenizer.whole(tokenizer.render_chat(chat), False)))
        except PromptError:
            pass
        return cls(checks)


async def check(session: aiohttp.ClientSession, url: str, probes: Probes) -> tuple[Result, str]:
    """Ask the engine at `url` to tokenize each probe; `ok`, `mismatch` (with where), or
    `unchecked` (no `/tokenize`, or it did not answer)."""
    for body, want in probes.checks:
        try:
            async with session.post(url + "/tokenize", json=body, timeout=_TIMEOUT) as resp:
                if resp.status != 200:
                    return "unchecked", f"/tokenize answered {resp.status}"
                got = msgspec.json.decode(await resp.read(), type=_Tokenized).tokens
        except (aiohttp.ClientError, TimeoutError) as exc:
            return "unchecked", f"/tokenize failed: {type(exc).__name__}"
        except msgspec.DecodeError as exc:
            return "unchecked", f"/tokenize answered no token list: {exc}"
        if got != want:
            kind = "chat" if "messages" in body else "completion"
            at = next(
                (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)),
            )
            return "mismatch", (
                f"{kind} probe: {len(got)} engine tokens vs {len(want)} router tokens, "
                f"first difference at {at}"
            )
    return "ok", ""
