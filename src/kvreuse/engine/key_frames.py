"""Keys read in place in more than one RoPE frame: documents attended where they were computed.

A document's KV is computed once, at the positions it was encoded at. A request places it
elsewhere; instead of copying its keys rotated to the new positions (``rope_shift.rotate``),
the request may read them where they are and rotate its *queries* the other way: RoPE is a
rotation, ``R(m) q . R(n + s) k = R(m - s) q . R(n) k``, so a query at position ``m`` scores a
key stored at ``n`` that stands for ``n + s`` exactly as the moved key would (up to rounding).

::

    KeyFrames.build(context slots [c], shifts [c], own intervals, rope)   once per forward
      groups   keys by shift; each group's slots as a few runs read in place, or gathered
      cos/sin  [layers, frames, d]: the rotation of a query by -shift for each frame
    frames.queries(layer, q [heads, n, d]) -> [frames, heads, n, d]   per layer
    KeyFrames.by_position(slots, shifts, key positions, query positions, rope, dtype, device)
      the same with every group gathered and masked by position (key visible to a query iff its
      position <= the query's): blend recomputing scattered tokens among documents read in place

Attention over the groups and the log-sum-exp merge are ``attention.py``'s. Full-attention
layers only: a sliding window masks keys by position, which the runner keeps on copied
documents (``document_cache``). Pure numpy/torch; no pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvreuse.engine.rope_shift import RopeShift, rotate_by

IN_PLACE_RUNS = 4  # a group in at most this many runs is read in place (a kernel call each), else gathered


@dataclass(frozen=True)
class KeyGroup:
    """Keys sharing one shift: ``frame`` indexes ``KeyFrames.cos``/``sin`` (``-1``: shift 0,
    the query as it is); read as ``runs`` (``(first slot, length)``, in place) or, when
    ``runs`` is empty, gathered through ``slots``."""

    frame: int
    runs: tuple[tuple[int, int], ...]
    slots: torch.Tensor | None  # [m] int64 on the pool's device, or None (runs)
    # by position only (``KeyFrames.by_position``): additive mask [n, m] in the queries' dtype
    # (0 visible, -inf not), and [n] bool rows that see no key of the group (their piece is
    # left out of the merge: the kernel gives such a row a log-sum-exp of 0, not -inf)
    mask: torch.Tensor | None = None
    blind: torch.Tensor | None = None


@dataclass(frozen=True)
class KeyFrames:
    """Every key of one item, grouped by the shift its query must undo."""

    groups: tuple[KeyGroup, ...]
    cos: torch.Tensor  # [layers, frames, d] fp32, angle -shift * inv_freq (rotate-half layout)
    sin: torch.Tensor  # [layers, frames, d]

    @classmethod
    def build(
        cls,
        slots: np.ndarray,
        shifts: np.ndarray,
        own_starts: np.ndarray,
        own_lengths: np.ndarray,
        rope: RopeShift,
        device: torch.device | str,
    ) -> KeyFrames:
        """``slots``/``shifts`` (``[c]`` int64 each): context keys and the positions each must
        move by; ``own_starts``/``own_lengths`` (``[k]`` int64): the item's own keys as slot
        intervals, shift 0. Keys of one shift are attended together, so the order does not
        matter (full attention: every key is visible to every query of the group)."""
        starts, lengths, run_shift = _runs_by_shift(slots, shifts)
        starts = np.concatenate((starts, own_starts))  # [r]
        lengths = np.concatenate((lengths, own_lengths))
        run_shift = np.concatenate((run_shift, np.zeros(len(own_starts), np.int64)))
        keep = lengths > 0
        starts, lengths, run_shift = starts[keep], lengths[keep], run_shift[keep]
        distinct = np.unique(run_shift)  # [u] ascending
        moved = distinct[distinct != 0]  # [frames]
        groups = []
        for shift in distinct.tolist():
            mine = np.flatnonzero(run_shift == shift)  # [runs of this shift]
            frame = -1 if shift == 0 else int(np.searchsorted(moved, shift))
            runs = tuple(zip(starts[mine].tolist(), lengths[mine].tolist()))
            if len(runs) <= IN_PLACE_RUNS:
                groups.append(KeyGroup(frame, runs, None))
            else:
                index = np.concatenate([np.arange(a, a + n, dtype=np.int64) for a, n in runs])  # [m]
                groups.append(KeyGroup(frame, (), torch.from_numpy(index).to(device)))
        return cls(tuple(groups), *_rotations(moved, rope, device))

    @property
    def masked(self) -> bool:
        """Whether the groups carry position masks (``by_position``): every key, the new tokens'
        own included, is in some group and visible only by position."""
        return any(g.mask is not None for g in self.groups)

    @classmethod
    def by_position(
        cls,
        slots: np.ndarray,
        shifts: np.ndarray,
        key_positions: np.ndarray,
        query_positions: np.ndarray,
        rope: RopeShift,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KeyFrames:
        """Every key (``[L]`` int64 ``slots``, ``shifts``, RoPE ``key_positions``; the new
        tokens' own keys included, shift 0) grouped by shift and gathered, each group with the
        mask of query ``i`` (at ``query_positions[i]``) seeing key ``j`` iff ``key_positions[j]
        <= query_positions[i]``. A group no query sees is dropped."""
        q_pos = torch.from_numpy(np.asarray(query_positions, np.int64)).to(device)[:, None]  # [n, 1]
        distinct = np.unique(shifts)  # [u] ascending
        moved = distinct[distinct != 0]  # [frames]
        groups = []
        for shift in distinct.tolist():
            mine = np.flatnonzero(shifts == shift)  # [m] keys of this shift
            k_pos = torch.from_numpy(key_positions[mine]).to(device)[None, :]  # [1, m]
            visible = k_pos <= q_pos  # [n, m]
            if not bool(visible.any()):
                continue
            mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            frame = -1 if shift == 0 else int(np.searchsorted(moved, shift))
            groups.append(
                KeyGroup(frame, (), torch.from_numpy(slots[mine]).to(device), mask, ~visible.any(dim=1))
            )  # [n]
        return cls(tuple(groups), *_rotations(moved, rope, device))

    def queries(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """``q`` (``[heads, n, d]``, RoPE applied) rotated into each frame: ``[frames, heads,
        n, d]`` in ``q``'s dtype, contiguous (computed in fp32)."""
        cos = self.cos[layer][:, None, None, :]  # [f, 1, 1, d]
        sin = self.sin[layer][:, None, None, :]
        return rotate_by(q, cos, sin).contiguous()  # [f, heads, n, d]


def _rotations(moved: np.ndarray, rope: RopeShift, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[layers, frames, d]`` fp32: the rotation by ``-moved[f]`` positions
    (computed in fp64)."""
    angle = -torch.from_numpy(moved).double()[None, :, None] * rope.inv_freq.double()[:, None, :]  # [L, f, d/2]
    angle = torch.cat((angle, angle), dim=-1)  # [L, f, d]
    return angle.cos().float().to(device), angle.sin().float().to(device)


def _runs_by_shift(slots: np.ndarray, shifts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of consecutive slots with one shift: ``([r] first slots, [r] lengths, [r]
    shifts)``."""
    if not len(slots):
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    opens = np.ones(len(slots), dtype=bool)  # [c] True where a run begins
    opens[1:] = (slots[1:] != slots[:-1] + 1) | (shifts[1:] != shifts[:-1])
    first = np.flatnonzero(opens)  # [r]
    lengths = np.diff(np.append(first, len(slots)))  # [r]
    return slots[first], lengths, shifts[first]
