"""The prefill → decode hand-off in the replay: a prompt prefilled on one simulated engine, its
KV moved to another, decoded there.

A remote placement enqueues the prompt on the prefill engine as a one-token request (vLLM's
producer: it computes the prompt minus its own cached prefix, answers one token, frees the
request and keeps the blocks cached). When that token comes out (t_p), the KV the decode engine
lacks crosses its link: the prompt minus the full leading blocks the decode engine holds at t_p
(as `router.placement.predicted_cached` counts them), × `kv_bytes_per_token`, at
`bandwidth_gbps`, plus `latency_ms` per transfer; transfers into one decode worker queue on its
link. At t_d the request joins the decode engine with the whole prompt's KV (`SimRequest.pulled`:
the blocks become cached there, so a conversation's next turn on that worker moves fewer), and
decodes. TTFT = t_p − arrival + transfer + the decode engine's first step.

With `prefill_answers` (the router's `on_prefill` mode), a prefill engine may run a whole
request, as an aggregated engine does: its prefill and decode passes, its cache keeping the
prompt; nothing moves P→D.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from replay.engine import SimEngine, SimRequest
from router.config import PdConfig
from router.placement import Mode, predicted_cached

REFERENCE_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
"""131,072: K and V × 32 layers × 8 KV heads × head dim 128 × 2 bytes (bf16), an 8B-class GQA
model (Llama-3.1-8B's layout), the size the reference engine's 1M-token KV cache fits on one
80-141 GB GPU beside its weights."""


class PdSettings(BaseModel):
    """The hand-off's transfer and the router's conditional disaggregation, for a P/D replay."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    local_prefill_tokens: int | None = Field(None, ge=0)
    """The router's `pd.local_prefill_tokens` (None: the router's default)."""
    local_prefill_by: Literal["threshold", "cost"] | None = None
    """The router's `pd.local_prefill_by` (None: the router's default); with `cost`, its
    `transfer_weight` and `handoff_tokens` below (None: the router's defaults)."""
    transfer_weight: float | None = Field(None, ge=0)
    handoff_tokens: int | None = Field(None, ge=0)
    bandwidth_gbps: float = Field(400.0, gt=0)
    """P→D link speed per decode worker, Gbit/s (default: one 400 Gb/s RDMA NIC per GPU)."""
    latency_ms: float = Field(2.0, ge=0)
    """Fixed time per transfer (the router's second hop, the transfer's set-up)."""
    kv_bytes_per_token: int = Field(REFERENCE_KV_BYTES_PER_TOKEN, gt=0)
    prefill_answers: bool = False
    """The router's `pd.prefill_answers`: a prefill worker may run a whole request, prefill and
    decode, its cache keeping the prompt."""
    drop_pulled: bool = False
    """An ideal, not an engine's behaviour: a decode engine's blocks of a pulled prompt are the
    first it evicts once the request ends (no copy of the prefill pool's KV stays there)."""

    def router(self) -> PdConfig:
        """The router's `pd` settings these replay (its defaults where a field is None)."""
        fields = ("local_prefill_tokens", "local_prefill_by", "transfer_weight", "handoff_tokens",
                  "prefill_answers")  # fmt: skip
        return PdConfig(**{f: getattr(self, f) for f in fields if getattr(self, f) is not None})

    def transfer_ms(self, nbytes: int) -> float:
        """Time `nbytes` occupy the link (without the fixed latency)."""
        return nbytes * 8 / (self.bandwidth_gbps * 1e6)


@dataclass(slots=True)
class Served:
    """How one request was served: its mode, workers and what crossed from prefill to decode."""

    mode: Mode
    worker: str
    """The worker that answered (aggregated, decode, or a prefill worker answering whole)."""
    prefill_worker: str = ""
    moved_tokens: int = 0
    """Prompt tokens whose KV was transferred (the prompt minus what decode held)."""
    bytes_moved: int = 0


@dataclass(slots=True, eq=False)
class Handoff:
    """One remote request between its prefill and its decode engine."""

    prefill: SimEngine
    decode: SimEngine
    leg: SimRequest
    """On the prefill engine: the prompt with one output token."""
    request: SimRequest
    """What joins the decode engine (pulled KV, the client's output length)."""
    served: Served


class Transfers:
    """Remote requests in flight, stepped in time order: prefill done → transfer → decode."""

    def __init__(self, settings: PdSettings, block_size: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self._prefilling: list[Handoff] = []
        self._events: list[tuple[float, int, bool, Handoff]] = []
        """(time, order, is-join, hand-off): a transfer starting, or a request joining decode."""
        self._order = 0
        self._link_free: dict[str, float] = {}
        self._pending: dict[str, tuple[int, int]] = {}
        """Decode worker → (requests, prompt tokens) placed there that have not joined yet."""

    def start(self, handoff: Handoff) -> None:
        """A remote decision: the prompt goes to the prefill engine now."""
        handoff.prefill.enqueue(handoff.leg)
        self._prefilling.append(handoff)
        n, tokens = self._pending.get(handoff.decode.name, (0, 0))
        self._pending[handoff.decode.name] = (n + 1, tokens + handoff.request.prompt)

    def pending(self, decode: str) -> tuple[int, int]:
        """(requests, prompt tokens) bound for `decode` still prefilling or in transfer: the
        router counts them in flight there from the placement on."""
        return self._pending.get(decode, (0, 0))

    def run(self, horizon: float) -> None:
        """Every transfer start and decode join before `horizon`; the prefill engines must have
        run to `horizon` (a prefill not done by then ends at or after it)."""
        still: list[Handoff] = []
        for h in self._prefilling:
            if h.leg.first_token >= 0:
                self._push(h.leg.first_token, False, h)
            else:
                still.append(h)
        self._prefilling = still
        events = self._events
        while events and events[0][0] < horizon:
            at, _, join, h = heapq.heappop(events)
            h.decode.advance(at)
            if join:
                self._join(h, at)
            else:
                self._send(h, at)

    def _push(self, at: float, join: bool, handoff: Handoff) -> None:
        self._order += 1
        heapq.heappush(self._events, (at, self._order, join, handoff))

    def _send(self, h: Handoff, at: float) -> None:
        """The prefill answered at `at`: move what the decode engine does not hold now."""
        req, cfg = h.request, self.settings
        held = h.decode.cached_prefix(req.keys, len(req.keys))
        moved = req.prompt - predicted_cached(held, req.prompt, self.block_size)
        nbytes = moved * cfg.kv_bytes_per_token
        begin = max(at, self._link_free.get(h.decode.name, 0.0))
        done = begin + cfg.transfer_ms(nbytes)
        self._link_free[h.decode.name] = done
        h.served.moved_tokens, h.served.bytes_moved = moved, nbytes
        self._push(done + cfg.latency_ms, True, h)

    def _join(self, h: Handoff, at: float) -> None:
        h.request.cached_tokens = h.leg.cached_tokens  # what the client is told (the router's)
        h.decode.enqueue(h.request, at)
        n, tokens = self._pending[h.decode.name]
        self._pending[h.decode.name] = (n - 1, tokens - h.request.prompt)
