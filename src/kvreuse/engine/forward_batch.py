"""What one forward pass attends over: each sequence's keys in the pool (``KeyTable``), the
prefill items attended one sequence at a time, the padded decode batch, and the
``ForwardContext`` the runner hands every layer (``attention.py`` reads it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from kvreuse.cache.kv_block import cdiv
from kvreuse.engine.key_frames import KeyFrames
from kvreuse.engine.kv_quant import KVStore

__all__ = ["KeyTable", "PrefillItem", "DecodeBatch", "ForwardContext"]


@dataclass(frozen=True)
class KeyTable:
    """Where one sequence's keys lie in the pool, in attention order: ``context_slots``
    (fixed slots, e.g. PML modules), then ``num_own`` own tokens, token ``t`` in slot
    ``block_ids[t // block_size] * block_size + t % block_size``.

    Slots and runs come from array arithmetic over the table, never a loop per token. The
    arrays are the sequence's own (views): valid for the step they were taken in.
    ``context_shifts[i]``: how many RoPE positions context key ``i`` stands away from where
    its K was computed (documents read in place, ``key_frames.py``); ``None``: none moves.
    """

    context_slots: np.ndarray  # [c] int64
    block_ids: np.ndarray  # [>= ceil(num_own / block_size)] int64, own blocks in token order
    block_size: int
    num_own: int  # own tokens that are keys (those computed before, then the new ones)
    context_shifts: np.ndarray | None = None  # [c] int64

    @property
    def num_keys(self) -> int:
        return len(self.context_slots) + self.num_own

    def own_slots(self, start: int, end: int) -> np.ndarray:
        """Slots of own tokens ``start..end-1``: ``[end - start]`` int64."""
        bs = self.block_size
        first, last = start // bs, cdiv(end, bs)
        slots = (self.block_ids[first:last, None] * bs + np.arange(bs)).reshape(-1)  # [(last - first) * bs]
        return slots[start - first * bs : end - first * bs]

    def own_intervals(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Own tokens ``start..end-1`` as one interval of consecutive slots per block:
        ``(first slots, lengths)``, each ``[blocks touched]`` int64."""
        bs = self.block_size
        if end <= start:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        first, last = start // bs, cdiv(end, bs)
        base = np.arange(first, last) * bs  # [m] index of each block's first token
        lo = np.maximum(start - base, 0)  # [m] first offset used in each block
        hi = np.minimum(end - base, bs)  # [m] one past the last
        return self.block_ids[first:last] * bs + lo, hi - lo

    def slots(self) -> np.ndarray:
        """Every key's slot, in attention order: ``[num_keys]`` int64."""
        return np.concatenate((self.context_slots, self.own_slots(0, self.num_own)))


@dataclass
class PrefillItem:
    """One sequence's new tokens attended one sequence at a time. The keys are read in
    place as ``kv_runs`` when there are few runs and the query is short, else gathered
    through ``kv_slots`` (built from the table the first time a layer asks)."""

    start: int  # first index of this sequence's new tokens in the flattened batch
    num_new: int
    keys: KeyTable  # every key (context + new), the new tokens last
    mask_full: torch.Tensor | None  # [num_new, L] bool, None = plain causal over new tokens only
    mask_sliding: Mapping[int, torch.Tensor | None]  # window -> [num_new, L] bool
    kv_runs: tuple[tuple[int, int], ...] = ()  # (first slot, length) runs covering the keys, if few
    device: torch.device | str = "cpu"  # where kv_slots is wanted (the pool's device)
    # True: the masks are the whole truth on every layer (keys visible by position, seam
    # repair); the keys are gathered and attended with the mask, never the implicit
    # "context all visible, new tokens causal" of the fused path.
    masked: bool = False
    # keys in several RoPE frames (documents read in place): attended group by group, each
    # with the query rotated into its frame (full-attention layers; never with masked)
    frames: KeyFrames | None = None

    @cached_property
    def kv_slots(self) -> torch.Tensor:
        """``[L]`` slots of every key (context + new), in attention order."""
        return torch.from_numpy(self.keys.slots()).to(self.device)  # [L]

    @cached_property
    def context_runs(self) -> tuple[tuple[int, int], ...]:
        """``kv_runs`` without the new tokens (the last ``num_new`` keys read): the context
        keys' runs; ``()`` when ``kv_runs`` is."""
        runs, drop = list(self.kv_runs), self.num_new
        while runs and drop:
            first, length = runs.pop()
            if length > drop:
                runs.append((first, length - drop))
            drop = max(drop - length, 0)
        return tuple(runs)

    @cached_property
    def context_slots_tensor(self) -> torch.Tensor:
        """``[L - num_new]`` slots of the context keys, in attention order."""
        return self.kv_slots[: self.keys.num_keys - self.num_new]


@dataclass
class DecodeBatch:
    token_index: torch.Tensor  # [B] index of each decode token in the flattened batch
    kv_slots: torch.Tensor  # [B, Lmax] slots (from each row's block table), padded with 0
    mask_full: torch.Tensor  # [B, 1, 1, Lmax] bool
    mask_sliding: dict[int, torch.Tensor]  # window -> [B, 1, 1, Lmax] bool


@dataclass
class ForwardContext:
    """What every layer needs to place and read KV for one forward pass."""

    # the pool (``KVStore``, any format) or a bare float tensor [layers, 2, kv_heads, num_slots,
    # head_dim] read in its own dtype (a scratch pass)
    kv_cache: torch.Tensor | KVStore
    slot_mapping: torch.Tensor  # [T] where each new token's k/v is written
    prefills: list[PrefillItem]
    decodes: DecodeBatch | None
    # --deterministic: plain items attend through engine/invariant_attention.py (a row's output
    # independent of the rows beside it); the runner then sends no padded decode batch
    invariant: bool = False
