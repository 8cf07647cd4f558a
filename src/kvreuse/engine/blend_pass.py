"""``BlendPass``: the model passes behind blend (the seams of assembled KV recomputed).

``Blend`` (engine/blend.py) chooses which assembled tokens to recompute; ``BlendedSource``
(engine/blended_context.py) gives them private slots. This module runs the two passes they
need over the model runner's KV tensor:

- ``seam_deviation``: how far each assembled token's cached K/V at one early layer is from
  its K/V recomputed against the whole assembled context (CacheBlend's selection signal);
- ``recompute``: the chosen tokens through every layer, by position, into their slots.

Engine thread only (it reads and writes the runner's KV tensor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvreuse.engine.attention import KeyTable
from kvreuse.engine.blend import DEVIATION_LAYER
from kvreuse.engine.model_runner import SeqChunk
from kvreuse.engine.rope_shift import RopeShift

if TYPE_CHECKING:
    from kvreuse.engine.model_runner import ModelRunner

# Blend's recompute in chunks of this many tokens (position order): each reads the keys up to
# its last position, so 2 chunks score ~3/4 of what one chunk over every key scores. 417 tokens
# over 4,063 keys (fp32, 1 thread, median of 3): 1024 -> 4.62 s, 256 -> 4.12 s, 128 -> 4.32 s,
# 64 -> 4.57 s (each chunk gathers its keys again and runs every layer's projections).
RECOMPUTE_CHUNK_TOKENS = 256


class BlendPass:
    """Blend's two passes over ``runner``'s KV tensor (``BlendedSource``'s ``BlendMechanics``)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    @torch.inference_mode()
    def seam_deviation(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        layer: int = DEVIATION_LAYER,
        shifts: np.ndarray | None = None,
    ) -> np.ndarray:
        """How far each assembled token's cached KV (in ``slots``) is from its KV recomputed
        against the whole assembled context: layers ``0..layer`` are run over every token
        at its RoPE position, each attending to the keys at or before its position, into a
        scratch tensor (the pool is only read), and the score is the squared L2 distance of
        layer ``layer``'s K and V. Returns ``[n]`` float64 (CacheBlend's selection signal).
        ``shifts`` (``[n]`` int64, documents read in place): how far each cached key stands
        from where it was computed; its K is rotated by that before the comparison."""
        runner = self.runner
        layer = min(layer, runner.layout.num_layers - 1)
        scratch = runner.forward_by_position(token_ids, positions, layer)  # [depth, 2, kv_heads, n, d]
        index = torch.tensor(list(slots), dtype=torch.long, device=runner.device)  # [n]
        cached = runner.kv.gather(layer, index).float()  # [2, kv_heads, n, d] as attention reads it
        if shifts is not None and np.any(shifts):  # keys read where computed: moved to their positions first
            one = RopeShift(runner.rope_shift().inv_freq[layer : layer + 1])  # this layer's frequencies
            delta = torch.from_numpy(np.asarray(shifts, dtype=np.int64).reshape(-1)).to(runner.device)  # [n]
            cached[0] = one.rotate(cached[0][None], delta)[0]  # [kv_heads, n, d]
        fresh = scratch[layer].float()  # [2, kv_heads, n, d]
        return ((fresh - cached) ** 2).sum(dim=(0, 1, 3)).cpu().numpy().astype(np.float64)  # [n]

    def recompute(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        selected: np.ndarray,
        chunk_tokens: int | None = None,
        shifts: np.ndarray | None = None,
    ) -> None:
        """Recompute the assembled tokens ``selected`` (``[m]`` ascending indices) through
        every layer, writing their new KV over their ``slots`` (which the caller owns: blend
        gives them private slots). Each attends to every assembled key at or before its
        position, the other tokens' cached KV and the selected ones' new KV.
        ``shifts`` (``[n]`` int64, 0 for the selected): keys read where they were computed
        (documents in place, ``key_frames.py``); ``None``: every key is at its position.
        Runs in chunks of ``chunk_tokens`` (default ``RECOMPUTE_CHUNK_TOKENS``) in position
        order, so a chunk sees the new KV of the chunks before it and nothing later; the result
        is that of one pass when positions are distinct. A chunk reads only the keys up to its
        last position: the masked kernel computes every score it is given, hidden or not, so
        short chunks skip most of the hidden ones (a staircase instead of the full rectangle)."""
        chunk_tokens = chunk_tokens or RECOMPUTE_CHUNK_TOKENS
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)  # [n]
        slot_arr = np.asarray(slots, dtype=np.int64).reshape(-1)  # [n]
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)  # [n]
        moved = None if shifts is None else np.asarray(shifts, dtype=np.int64).reshape(-1)  # [n]
        sel = np.asarray(selected, dtype=np.int64).reshape(-1)  # [m]
        sel = sel[np.argsort(pos[sel], kind="stable")]  # position order
        for start in range(0, len(sel), chunk_tokens):
            part = sel[start : start + chunk_tokens]  # [k]
            # every assembled key but this chunk's, up to the chunk's last position (no query of
            # the chunk sees a later one, so it is not read)
            others = pos <= pos[part].max()  # [n]
            others[part] = False
            keys = np.flatnonzero(others)  # [<= n - k]
            key_shifts = None if moved is None or not moved[keys].any() else moved[keys]
            chunk = SeqChunk(
                ids[part].tolist(),
                pos[part].tolist(),
                KeyTable(slot_arr[keys], slot_arr[part], 1, len(part), key_shifts),
                pos[keys],
                False,
                by_position=True,
            )
            self.runner.execute([chunk])
