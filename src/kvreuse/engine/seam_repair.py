"""``SeamRepair``: which assembled tokens to recompute against the assembled context.

Modules (PML) and documents are encoded apart, so their KV never attended to each other.
Before a request's own tokens run, a chosen set of the assembled tokens is recomputed
through every layer against everything before it by position (the mechanics are the model
runner's: ``ModelRunner.seam_deviation`` / ``recompute``; the copy-on-write is
``engine/repaired_context.py``'s). This object only chooses, from two knobs:

- ``first_tokens`` (EPIC's attention-sink fix): the first ``k`` tokens of every segment
  (module or document);
- ``ratio`` (CacheBlend): the ``round(ratio * n)`` tokens of the ``n`` assembled ones whose
  early-layer KV deviates most from the cached KV when recomputed against the assembled
  context (``deviation``, one score per token, larger = more deviant).

The chosen set is the union of the two. ``SeamRepair()`` (both 0) chooses nothing: the
request runs exactly as without repair. Pure: no pool, no model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SeamRepair:
    """The repair a request asks for; validated where built (``ValueError`` naming the field)."""

    first_tokens: int = 0  # leading tokens of each segment always recomputed (0: none)
    ratio: float = 0.0  # share of the assembled tokens recomputed by KV deviation, in [0, 1]

    def __post_init__(self) -> None:
        if isinstance(self.first_tokens, bool) or not isinstance(self.first_tokens, int) or self.first_tokens < 0:
            raise ValueError(f"blend.first_tokens must be an integer >= 0, got {self.first_tokens!r}")
        if (isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float))
                or not math.isfinite(self.ratio) or not 0.0 <= self.ratio <= 1.0):
            raise ValueError(f"blend.ratio must be a number in [0, 1], got {self.ratio!r}")

    @classmethod
    def from_json(cls, obj: object, default: "SeamRepair") -> "SeamRepair":
        """A request's ``blend`` field: ``None`` -> ``default`` (the server's setting); an
        object with ``first_tokens`` and/or ``ratio`` (a missing one takes the default's
        value). Raises ``ValueError`` naming the field."""
        if obj is None:
            return default
        if isinstance(obj, SeamRepair):
            return obj
        if not isinstance(obj, Mapping):
            raise ValueError(f"blend must be an object {{\"first_tokens\": k, \"ratio\": r}}, got {type(obj).__name__}")
        unknown = sorted(set(obj) - {"first_tokens", "ratio"})
        if unknown:
            raise ValueError(f"blend: unknown field(s) {unknown}; expected first_tokens, ratio")
        first = obj.get("first_tokens")
        ratio = obj.get("ratio")
        return cls(default.first_tokens if first is None else first, default.ratio if ratio is None else ratio)

    @property
    def enabled(self) -> bool:
        """Whether anything is ever recomputed."""
        return self.first_tokens > 0 or self.ratio > 0

    def num_by_deviation(self, num_tokens: int) -> int:
        """How many of ``num_tokens`` assembled tokens the ratio picks."""
        return min(num_tokens, int(round(self.ratio * num_tokens)))

    def select(self, segment_starts: np.ndarray, num_tokens: int, deviation: np.ndarray | None) -> np.ndarray:
        """Indices (into the assembled tokens, ascending, unique) to recompute: ``[m]`` int64.

        ``segment_starts``: ``[s]`` int64 first index of each segment (ascending; a segment
        runs to the next start or ``num_tokens``). ``deviation``: ``[num_tokens]`` scores,
        needed when ``num_by_deviation(num_tokens)`` > 0 (ties: the earlier token first)."""
        chosen = np.zeros(num_tokens, dtype=bool)  # [n]
        if self.first_tokens > 0 and num_tokens:
            starts = np.asarray(segment_starts, dtype=np.int64).reshape(-1)  # [s]
            ends = np.append(starts[1:], num_tokens)  # [s]
            lengths = np.minimum(ends - starts, min(self.first_tokens, num_tokens))  # [s] (no int64 overflow)
            offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            chosen[np.repeat(starts, lengths) + offsets] = True
        k = self.num_by_deviation(num_tokens)
        if k:
            if deviation is None or len(deviation) != num_tokens:
                raise ValueError(f"blend.ratio {self.ratio} needs one deviation score per assembled token")
            order = np.argsort(-np.asarray(deviation, dtype=np.float64), kind="stable")  # [n] most deviant first
            chosen[order[:k]] = True
        return np.flatnonzero(chosen).astype(np.int64)
