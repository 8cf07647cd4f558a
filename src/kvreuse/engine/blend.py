"""``Blend``: which assembled tokens to recompute against the assembled context.

Modules (PML) and documents are encoded apart, so their KV never attended to each other.
Before a request's own tokens run, a chosen set of the assembled tokens is recomputed
through every layer against everything before it by position (the model passes are
``engine/blend_pass.py``'s; the copy-on-write is ``engine/blended_context.py``'s).
This object only chooses, from these knobs (a request's ``blend`` field, the server's
``--blend-*`` / ``--document-blend-*``; the idea is CacheBlend's and EPIC's, the one name
in this code is *blend*):

- ``first_tokens`` (EPIC's attention-sink fix): the first ``k`` tokens of every segment
  (module or document);
- ``last_tokens``: the last ``k`` tokens of every segment, the ones right before a seam;
- ``ratio`` (CacheBlend): the ``round(ratio * n)`` tokens of the ``n`` assembled ones whose
  early-layer KV deviates most from the cached KV when recomputed against the assembled
  context (``deviation``, one score per token, larger = more deviant);
- ``deviation_layer``: the layer whose K/V that deviation compares (default 1, CacheBlend's
  signal; layer 0's K/V depends on nothing but the token and its position, so it is never
  asked for). The pass runs layers ``0..deviation_layer`` over every assembled token, so a
  deeper layer costs ``deviation_layer + 1`` layers of the context's prefill instead of 2
  (a layer past the model's last means its last); only read when the ratio picks a token.

The chosen set is the union of the three. ``Blend()`` (all 0) chooses nothing: the
request runs exactly as without blend. Pure: no pool, no model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

DEVIATION_LAYER = 1  # CacheBlend's: the deviation pass runs layers 0..1 over the context
FIELDS = ("first_tokens", "ratio", "deviation_layer", "last_tokens")  # a request's blend knobs


@dataclass(frozen=True)
class Blend:
    """The blend a request asks for: parsed once, at the edge (``from_json``), and carried as
    this value to the engine; validated where built (``ValueError`` naming the field)."""

    first_tokens: int = 0  # leading tokens of each segment always recomputed (0: none)
    ratio: float = 0.0  # share of the assembled tokens recomputed by KV deviation, in [0, 1]
    deviation_layer: int = DEVIATION_LAYER  # layer whose K/V deviation ranks tokens for the ratio
    last_tokens: int = 0  # trailing tokens of each segment always recomputed (0: none)

    def __post_init__(self) -> None:
        for name in ("first_tokens", "last_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"blend.{name} must be an integer >= 0, got {value!r}")
        if (
            isinstance(self.ratio, bool)
            or not isinstance(self.ratio, (int, float))
            or not math.isfinite(self.ratio)
            or not 0.0 <= self.ratio <= 1.0
        ):
            raise ValueError(f"blend.ratio must be a number in [0, 1], got {self.ratio!r}")
        if (
            isinstance(self.deviation_layer, bool)
            or not isinstance(self.deviation_layer, int)
            or self.deviation_layer < 1
        ):  # layer 0's K/V is the token's and position's alone: it never deviates
            raise ValueError(f"blend.deviation_layer must be an integer >= 1, got {self.deviation_layer!r}")

    @classmethod
    def from_json(cls, obj: object, default: Blend) -> Blend:
        """A request's ``blend`` field: ``None`` -> ``default`` (the server's setting); an
        object with any of ``first_tokens``, ``ratio``, ``deviation_layer``, ``last_tokens`` (a
        missing one takes the default's value). Raises ``ValueError`` naming the field."""
        if obj is None:
            return default
        if isinstance(obj, Blend):
            return obj
        if not isinstance(obj, Mapping):
            raise ValueError(f"blend must be an object {{\"first_tokens\": k, \"ratio\": r}}, got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(FIELDS))
        if unknown:
            raise ValueError(f"blend: unknown field(s) {unknown}; expected {', '.join(FIELDS)}")
        return cls(**{f: getattr(default, f) if obj.get(f) is None else obj[f] for f in FIELDS})

    @property
    def enabled(self) -> bool:
        """Whether anything is ever recomputed."""
        return self.first_tokens > 0 or self.last_tokens > 0 or self.ratio > 0

    def most_by_position(self, num_segments: int, num_tokens: int) -> int:
        """An upper bound on the tokens ``first_tokens`` and ``last_tokens`` choose."""
        return min(num_tokens, (min(self.first_tokens, num_tokens) + min(self.last_tokens, num_tokens)) * num_segments)

    def num_by_deviation(self, num_tokens: int) -> int:
        """How many of ``num_tokens`` assembled tokens the ratio picks."""
        return min(num_tokens, int(round(self.ratio * num_tokens)))

    def select(self, segment_starts: np.ndarray, num_tokens: int, deviation: np.ndarray | None) -> np.ndarray:
        """Indices (into the assembled tokens, ascending, unique) to recompute: ``[m]`` int64.

        ``segment_starts``: ``[s]`` int64 first index of each segment (ascending; a segment
        runs to the next start or ``num_tokens``). ``deviation``: ``[num_tokens]`` scores,
        needed when ``num_by_deviation(num_tokens)`` > 0 (ties: the earlier token first)."""
        chosen = np.zeros(num_tokens, dtype=bool)  # [n]
        starts = np.asarray(segment_starts, dtype=np.int64).reshape(-1)  # [s]
        ends = np.append(starts[1:], num_tokens)  # [s]
        if self.first_tokens > 0 and num_tokens:
            lengths = np.minimum(ends - starts, min(self.first_tokens, num_tokens))  # [s] (no int64 overflow)
            chosen[_runs(starts, lengths)] = True
        if self.last_tokens > 0 and num_tokens:
            lengths = np.minimum(ends - starts, min(self.last_tokens, num_tokens))  # [s]
            chosen[_runs(ends - lengths, lengths)] = True
        k = self.num_by_deviation(num_tokens)
        if k:
            if deviation is None or len(deviation) != num_tokens:
                raise ValueError(f"blend.ratio {self.ratio} needs one deviation score per assembled token")
            order = np.argsort(-np.asarray(deviation, dtype=np.float64), kind="stable")  # [n] most deviant first
            chosen[order[:k]] = True
        return np.flatnonzero(chosen).astype(np.int64)


@dataclass(frozen=True)
class BlendOverride:
    """A request's ``blend`` as parsed once at the edge (the HTTP routes, ``LLM.generate``) and
    carried to the engine: the knobs it sets, ``None`` for each it leaves to the server's
    default for its prompt's kind (``--blend-*`` for PML modules, ``--document-blend-*`` for
    documents, known only where the prompt is assembled). Valid by construction through ``of``;
    ``over(default)`` is the ``Blend`` that runs."""

    first_tokens: int | None = None
    ratio: float | None = None
    deviation_layer: int | None = None
    last_tokens: int | None = None

    @classmethod
    def of(cls, obj: object) -> BlendOverride | None:
        """``None`` -> ``None`` (every knob the default's); a ``BlendOverride`` itself; a ``Blend``
        (every knob set); or the JSON object ``Blend.from_json`` reads. Raises ``ValueError``
        naming the field."""
        if obj is None or isinstance(obj, BlendOverride):
            return obj
        if isinstance(obj, Blend):
            return cls(**{f: getattr(obj, f) for f in FIELDS})
        Blend.from_json(obj, Blend())  # checks the object, its field names and every value given
        return cls(**{f: obj.get(f) for f in FIELDS})  # type: ignore[attr-defined]  # a Mapping: checked above

    def over(self, default: Blend) -> Blend:
        """The blend that runs: these knobs, ``default``'s where ``None``."""
        return Blend(**{f: getattr(default, f) if getattr(self, f) is None else getattr(self, f) for f in FIELDS})


def _runs(firsts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices of runs ``firsts[i] .. firsts[i] + lengths[i] - 1``, concatenated: ``[sum(lengths)]``."""
    offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(firsts, lengths) + offsets
