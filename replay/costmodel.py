"""Engine cost models for the simulator: how long one scheduler pass takes.

A model is anything with `prefill_ms(tokens)` and `decode_ms(utilisation)` (`CostModel`).
`ReferenceModel` is the polynomial fit NVIDIA Dynamo's mocker uses (ENGINES.md):

    prefill_ms(T) = 4.209989e-07·T² + 1.518344e-02·T + 16.50142   (T = uncached tokens in the pass)
    decode_ms(p)  = max(1, −25.74·p² + 54.01·p + 5.74)            (p = running KV / KV capacity)

A lone 8,192-token prompt therefore takes 169.1 ms; a full prefix hit (one 64-token block
recomputed) 17.5 ms.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]


@runtime_checkable
class CostModel(Protocol):
    """Duration of the prefill and decode parts of one scheduler pass, in milliseconds."""

    def prefill_ms(self, tokens: int) -> float:
        """Prefill time for `tokens` uncached tokens computed in one pass (0 → 0)."""
        ...

    def decode_ms(self, utilisation: F64) -> F64:
        """Decode time of a pass per KV utilisation p ∈ [0, 1] (vectorised over passes)."""
        ...


class ReferenceModel:
    """The Dynamo mocker's polynomial model (see the module docstring for the formulas)."""

    def __init__(
        self,
        prefill: tuple[float, float, float] = (4.209989e-07, 1.518344e-02, 16.50142),
        decode: tuple[float, float, float] = (-25.74, 54.01, 5.74),
        decode_floor_ms: float = 1.0,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.decode_floor_ms = decode_floor_ms

    def prefill_ms(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        a, b, c = self.prefill
        return a * tokens * tokens + b * tokens + c

    def decode_ms(self, utilisation: F64) -> F64:
        a, b, c = self.decode
        p = np.minimum(utilisation, 1.0)
        out: F64 = np.maximum(self.decode_floor_ms, (a * p + b) * p + c)
        return out


class Scaled:
    """Another model's pass times divided by `speed` (a pool of faster or slower engines)."""

    def __init__(self, model: CostModel, speed: float) -> None:
        if speed <= 0:
            raise ValueError("speed must be positive")
        self.model = model
        self.speed = speed

    def prefill_ms(self, tokens: int) -> float:
        return self.model.prefill_ms(tokens) / self.speed

    def decode_ms(self, utilisation: F64) -> F64:
        out: F64 = self.model.decode_ms(utilisation) / self.speed
        return out
